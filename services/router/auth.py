"""Bearer tokens -> tenants and roles. The tenant comes from the token, never from a field.

Tenants file (YAML or JSON), mounted from a Secret in Kubernetes:

    tenants:
      acme:   {tokens: [tok-acme-1], role: user, weight: 1.0,
               quota: {requests_per_s: 20, tokens_per_s: 4000, max_in_flight: 16}}
      ops:    {tokens: [tok-ops], role: admin}
    default_quota: {requests_per_s: 50, max_in_flight: 32}

Without a tenants file the router runs in dev mode: the token is the tenant's name (no token:
tenant "dev") and every tenant may register adapters.
"""
from __future__ import annotations

import hmac
import json
import logging
import pathlib
import re
from dataclasses import dataclass, field

from services.common.errors import PermissionDenied, Unauthenticated
from services.router.quotas import QuotaConfig

log = logging.getLogger(__name__)
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ROLES = {"user", "admin"}


@dataclass(frozen=True)
class Caller:
    tenant: str
    admin: bool


@dataclass
class Tenants:
    tokens: dict[str, Caller] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    quotas: QuotaConfig = field(default_factory=QuotaConfig)
    dev_mode: bool = True

    @classmethod
    def load(cls, path: str | None) -> "Tenants":
        if not path:
            return cls()
        text = pathlib.Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            import yaml
            data = yaml.safe_load(text)
        return cls.from_dict(data or {})

    @classmethod
    def from_dict(cls, data: dict) -> "Tenants":
        """Parse the tenants file; ValueError names what is wrong (the router does not start)."""
        _only(data, {"tenants", "default_quota"}, "tenants file")
        tokens, weights, quota_map = {}, {}, {}
        for name, spec in (data.get("tenants") or {}).items():
            if not TENANT_NAME.match(str(name)):
                raise ValueError(f"tenants file: bad tenant name {name!r}")
            spec = spec or {}
            _only(spec, {"tokens", "role", "weight", "quota"}, f"tenant {name!r}")
            role = spec.get("role", "user")
            if role not in ROLES:
                raise ValueError(f"tenant {name!r}: role {role!r} is not one of {sorted(ROLES)}")
            for tok in spec.get("tokens") or []:
                if not str(tok) or str(tok) in tokens:
                    raise ValueError(f"tenant {name!r}: empty or repeated token")
                tokens[str(tok)] = Caller(str(name), role == "admin")
            weights[str(name)] = float(spec.get("weight", 1.0))
            if spec.get("quota"):
                quota_map[str(name)] = spec["quota"]
        quotas = QuotaConfig.from_dict({"default": data.get("default_quota") or {},
                                        "tenants": quota_map})
        return cls(tokens, weights, quotas, dev_mode=False)

    def authenticate(self, metadata) -> Caller:
        """The caller behind the `authorization: Bearer T` metadata."""
        token = bearer(metadata)
        if self.dev_mode:
            name = token or "dev"
            if not TENANT_NAME.match(name):
                raise Unauthenticated("dev mode: the token must be a tenant name")
            return Caller(name, admin=True)
        if token is None:
            raise Unauthenticated("missing bearer token (metadata 'authorization: Bearer ...')")
        for known, caller in self.tokens.items():
            if hmac.compare_digest(known, token):
                return caller
        raise Unauthenticated("invalid bearer token")


def _only(spec: dict, keys: set[str], where: str) -> None:
    unknown = sorted(set(spec) - keys)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (expected some of {sorted(keys)})")


def bearer(metadata) -> str | None:
    """The token of the `authorization: Bearer T` metadata; None when there is none. Any other
    authorization value (another scheme, no token) is UNAUTHENTICATED, in dev mode too: a
    client that sends credentials the router cannot read is told, not served as `dev`."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
            return token.strip()
    return None


def require_admin(caller: Caller) -> None:
    if not caller.admin:
        raise PermissionDenied(f"tenant {caller.tenant!r} may not manage adapters (admin only)")
