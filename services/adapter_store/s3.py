"""boto3 access to S3/MinIO for the store: clients whose socket timeouts fit the caller's deadline,
and botocore failures mapped to domain errors.

Credentials come from boto3's standard chain (env, shared files, instance/pod roles) and are never
logged; the endpoint is logged without any user-info part. Retries use botocore's "standard"
mode. A client's connect/read timeouts are the configured ones, cut down to the caller's
remaining deadline split over the attempts (rounded down to a small ladder so a handful of clients is ever built).
"""
from __future__ import annotations

import logging
import threading
import urllib.parse

from opentelemetry import trace

from services.common.errors import DeadlineExceeded, FailedPrecondition, NotFound, Unavailable

log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)
# Timeouts are rounded down to one of these (seconds), so clients are reused across calls.
_LADDER = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
ATTEMPTS = 3  # botocore "standard" retry mode: the first try and two retries
_MISSING = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}
_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"}


class MissingFile(NotFound):
    """A file the source should hold is not there (NOT_FOUND; register turns it into a refusal)."""


def redact(url: str | None) -> str:
    """An endpoint URL without user-info (user:password@), for logs."""
    if not url:
        return "(AWS default)"
    parts = urllib.parse.urlsplit(url)
    return parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")
                          ).geturl()


class S3Clients:
    """One boto3 session, made at the first S3 read (a store without S3 sources never imports
    boto3); one client per (connect, read) timeout rung, built on demand."""

    def __init__(self, endpoint: str | None, region: str, connect_timeout: float,
                 read_timeout: float):
        self._session = None
        self._endpoint, self._region = endpoint, region
        self._connect, self._read = connect_timeout, read_timeout
        self._clients: dict[tuple[float, float], object] = {}
        self._lock = threading.Lock()  # boto3 sessions are not thread-safe; clients are
        log.info("S3 endpoint %s, region %s", redact(endpoint), region)

    def client(self, remaining: float | None):
        """A client whose attempts, retries included, fit in `remaining` seconds (None: no
        deadline): each socket timeout is at most remaining / ATTEMPTS."""
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded("deadline exceeded before reading the source")
        per_attempt = None if remaining is None else remaining / ATTEMPTS
        key = (_rung(self._connect, per_attempt), _rung(self._read, per_attempt))
        with self._lock:
            if key not in self._clients:
                self._clients[key] = self._build(*key)
            return self._clients[key]

    def _build(self, connect: float, read: float):
        from botocore.config import Config
        if self._session is None:
            import boto3
            self._session = boto3.session.Session()
        config = Config(connect_timeout=connect, read_timeout=read,
                        retries={"mode": "standard", "max_attempts": ATTEMPTS},
                        region_name=self._region, signature_version="s3v4")
        return self._session.client("s3", endpoint_url=self._endpoint, config=config)


def _rung(limit: float, remaining: float | None) -> float:
    bound = limit if remaining is None else min(limit, remaining)
    fits = [r for r in _LADDER if r <= bound]
    return fits[-1] if fits else _LADDER[0]


def head_size(client, bucket: str, key: str) -> int | None:
    """ContentLength of an object, or None when it does not exist."""
    from botocore.exceptions import ClientError
    try:
        return int(client.head_object(Bucket=bucket, Key=key)["ContentLength"])
    except ClientError as exc:
        if _code(exc) in _MISSING:
            return None
        raise _mapped(exc, bucket, key) from None
    except Exception as exc:  # noqa: BLE001 - network and credential failures
        raise _mapped(exc, bucket, key) from None


def get(client, bucket: str, key: str, cap: int) -> bytes:
    """An object's bytes, reading at most cap + 1 (a larger object is refused by the caller)."""
    from botocore.exceptions import ClientError
    with _tracer.start_as_current_span("s3.get") as span:
        span.set_attribute("s3.bucket", bucket)
        span.set_attribute("s3.key", key)
        try:
            body = client.get_object(Bucket=bucket, Key=key)["Body"]
            with body:
                data = body.read(cap + 1)
        except ClientError as exc:
            if _code(exc) in _MISSING:
                raise MissingFile(f"s3://{bucket}/{key}: object not found") from None
            raise _mapped(exc, bucket, key) from None
        except Exception as exc:  # noqa: BLE001 - network and credential failures
            raise _mapped(exc, bucket, key) from None
        span.set_attribute("lora.bytes", len(data))
        return data


def _code(exc) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _mapped(exc: Exception, bucket: str, key: str) -> Exception:
    """A botocore failure as a domain error (the message never carries credentials)."""
    from botocore import exceptions as bx
    where = f"s3://{bucket}/{key}"
    if isinstance(exc, bx.ClientError):
        code = _code(exc)
        if code in _DENIED:
            return FailedPrecondition(f"source {where}: access denied ({code})")
        return Unavailable(f"source {where}: S3 error {code or 'unknown'}")
    if isinstance(exc, (bx.ConnectTimeoutError, bx.ReadTimeoutError)):
        return DeadlineExceeded(f"source {where}: S3 timed out ({type(exc).__name__})")
    if isinstance(exc, bx.NoCredentialsError):
        return FailedPrecondition("source: no S3 credentials (standard AWS chain)")
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectionClosedError,
                        bx.HTTPClientError)):
        return Unavailable(f"source {where}: S3 endpoint unreachable ({type(exc).__name__})")
    log.warning("unexpected S3 failure for %s: %s", where, type(exc).__name__)
    return Unavailable(f"source {where}: S3 failure ({type(exc).__name__})")
