"""A small Python client for the router's GenerationService."""
from __future__ import annotations

from typing import Iterator, Sequence

import grpc

from services.common.gen.lorafleet.v1 import common_pb2, router_pb2 as rpb, router_pb2_grpc


class LorafleetClient:
    """Synchronous client. `token` is the bearer token that names your tenant.

    TLS: `ca` verifies the router's certificate; `cert` + `key` present a client certificate
    (a router started with --tls-ca requires one). Errors are grpc.RpcError; for
    RESOURCE_EXHAUSTED, `services.common.errors.retry_after_of(err)` is the delay to wait.
    """

    def __init__(self, target: str = "127.0.0.1:7001", token: str | None = None,
                 timeout: float = 120.0, ca: str | None = None, cert: str | None = None,
                 key: str | None = None):
        if ca or cert:
            creds = grpc.ssl_channel_credentials(_read(ca), _read(key), _read(cert))
            self._channel = grpc.secure_channel(target, creds)
        else:
            self._channel = grpc.insecure_channel(target)
        self._stub = router_pb2_grpc.GenerationServiceStub(self._channel)
        self._metadata = [("authorization", f"Bearer {token}")] if token else []
        self.timeout = timeout

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "LorafleetClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def request(prompt: str = "", *, adapter: str = "", prompt_ids: Sequence[int] = (),
                max_new_tokens: int = 0, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 0.0, seed: int = 0, repetition_penalty: float = 0.0,
                stop: Sequence[str] = (), time_limit_ms: int = 0, ignore_eos: bool = False,
                request_id: str = "", messages: Sequence[dict] = (),
                presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                logit_bias: dict[int, float] | None = None, min_new_tokens: int = 0,
                logprobs: bool = False, top_n_tokens: int = 0,
                prompt_logprobs: bool = False) -> rpb.GenerateRequest:
        """messages: a chat ({"role", "content"} dicts) instead of the prompt, rendered with
        the model's chat template by the worker; logprobs / top_n_tokens: each token's
        log-probability (and the n likeliest alternatives) in the responses' `tokens`."""
        req = rpb.GenerateRequest(adapter_id=adapter, text=prompt,
                                  prompt_token_ids=list(prompt_ids), request_id=request_id,
                                  messages=chat_messages(messages))
        req.sampling.presence_penalty = presence_penalty
        req.sampling.frequency_penalty = frequency_penalty
        for token, bias in (logit_bias or {}).items():
            req.sampling.logit_bias[token] = bias
        req.stopping.min_new_tokens = min_new_tokens
        req.response.token_logprobs, req.response.top_n_tokens = logprobs, top_n_tokens
        req.response.prompt_logprobs = prompt_logprobs
        req.sampling.temperature, req.sampling.top_k, req.sampling.top_p = temperature, top_k, top_p
        req.sampling.seed, req.sampling.repetition_penalty = seed, repetition_penalty
        req.stopping.max_new_tokens = max_new_tokens
        req.stopping.stop_sequences.extend(stop)
        req.stopping.time_limit_ms = time_limit_ms
        req.stopping.ignore_eos = ignore_eos
        return req

    def generate(self, prompt: str = "", **kw) -> rpb.GenerateResponse:
        return self._stub.Generate(self.request(prompt, **kw), timeout=self.timeout,
                                   metadata=self._metadata)

    def generate_stream(self, prompt: str = "", **kw) -> Iterator[rpb.GenerateResponse]:
        return self._stub.GenerateStream(self.request(prompt, **kw), timeout=self.timeout,
                                         metadata=self._metadata)

    def generate_batch(self, requests: Sequence[rpb.GenerateRequest]
                       ) -> list[rpb.GenerateResponse]:
        """Several completions in one call (build each with `request(...)`), in order."""
        return list(self._stub.GenerateBatch(rpb.GenerateBatchRequest(requests=list(requests)),
                                             timeout=self.timeout,
                                             metadata=self._metadata).responses)

    def register(self, adapter_id: str, source: str, tenant: str = "",
                 aliases: Sequence[str] = (), replace: bool = False) -> rpb.AdapterInfo:
        """replace: register a new version of an existing id (else ALREADY_EXISTS)."""
        req = rpb.RegisterAdapterRequest(id=adapter_id, source=source, tenant=tenant,
                                         aliases=list(aliases), replace=replace)
        return self._stub.RegisterAdapter(req, timeout=self.timeout,
                                          metadata=self._metadata).adapter

    def set_alias(self, alias: str, target: str) -> rpb.AdapterInfo:
        """Point alias at an adapter id (its current version) or ID@VERSION (pinned: a
        rollback); the adapter it now names (admin)."""
        return self._stub.SetAlias(rpb.SetAliasRequest(alias=alias, target=target),
                                   timeout=self.timeout, metadata=self._metadata).adapter

    def delete(self, adapter_id: str) -> None:
        self._stub.DeleteAdapter(rpb.DeleteAdapterRequest(id=adapter_id), timeout=self.timeout,
                                 metadata=self._metadata)

    def adapters_page(self, page_size: int = 0, page_token: str = "", owner: str = "",
                      prefix: str = "") -> rpb.ListAdaptersResponse:
        """One page of the adapters the caller may use (next_page_token "" on the last)."""
        req = rpb.ListAdaptersRequest(page_size=page_size, page_token=page_token, owner=owner,
                                      prefix=prefix)
        return self._stub.ListAdapters(req, timeout=self.timeout, metadata=self._metadata)

    def iter_adapters(self, page_size: int = 0, owner: str = "", prefix: str = "",
                      limit: int | None = None) -> Iterator[rpb.AdapterInfo]:
        """Every adapter the caller may use (or the first `limit`), in id order, a page a
        call."""
        token, left = "", limit
        while left is None or left > 0:
            size = page_size if left is None else min(page_size or left, left)
            page = self.adapters_page(size, token, owner, prefix)
            yield from page.adapters[:left]
            if left is not None:
                left -= len(page.adapters)
            token = page.next_page_token
            if not token:
                return

    def adapters(self, page_size: int = 0, owner: str = "", prefix: str = "",
                 limit: int | None = None) -> list[rpb.AdapterInfo]:
        """iter_adapters as a list."""
        return list(self.iter_adapters(page_size, owner, prefix, limit))

    def versions(self, adapter_id: str) -> rpb.ListAdapterVersionsResponse:
        """The versions the store keeps of an adapter (newest first): what ID@VERSION and a
        pinned alias can name."""
        return self._stub.ListAdapterVersions(
            rpb.ListAdapterVersionsRequest(adapter_id=adapter_id), timeout=self.timeout,
            metadata=self._metadata)

    def stats(self) -> rpb.GetStatsResponse:
        return self._stub.GetStats(rpb.GetStatsRequest(), timeout=self.timeout,
                                   metadata=self._metadata)

    def model_info(self) -> rpb.ModelInfoResponse:
        return self._stub.ModelInfo(rpb.ModelInfoRequest(), timeout=self.timeout,
                                    metadata=self._metadata)

    def tokenize(self, text: str = "", messages: Sequence[dict] = ()) -> rpb.TokenizeResponse:
        return self._stub.Tokenize(rpb.TokenizeRequest(text=text,
                                                       messages=chat_messages(messages)),
                                   timeout=self.timeout, metadata=self._metadata)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._stub.Detokenize(rpb.DetokenizeRequest(token_ids=list(token_ids)),
                                     timeout=self.timeout, metadata=self._metadata).text


def chat_messages(messages: Sequence[dict]) -> list[common_pb2.ChatMessage]:
    return [common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()
