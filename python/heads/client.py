"""Client of ``heads serve`` over gRPC (proto/heads/v1/heads.proto); needs the ``grpcio`` and
``protobuf`` packages (``pip install heads[client]``).

    from heads.client import Client
    with Client("127.0.0.1:50051") as c:
        e = c.embed(["a sentence", "another"])      # float32 [2, dim]
        ranks = c.rerank("query", ["a", "b"])        # a reranker served: [{"index", "score"}, ...]
        print(c.model_version)                      # the model that computed them

Errors come back as ``grpc.RpcError`` with the server's status code and message
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, UNAVAILABLE, ...).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

try:
    import grpc
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("heads.client needs grpcio: pip install grpcio protobuf") from e

try:
    from .v1 import heads_pb2, heads_pb2_grpc
except ImportError as e:  # pragma: no cover - depends on how heads was built
    raise ImportError(
        "heads.client: the gRPC stubs (heads.v1.heads_pb2) were not built; install protoc and "
        "grpc_python_plugin (Debian: protobuf-compiler-grpc) and reinstall heads") from e

__all__ = ["Client"]


def _tensor(a, name: str) -> "heads_pb2.Tensor":
    a = np.asarray(a.detach().cpu().numpy() if hasattr(a, "detach") else a, dtype=np.float32)
    if a.ndim < 1 or a.ndim > 3:
        raise ValueError(f"{name}: expected 1 to 3 dimensions, got shape {list(a.shape)}")
    t = heads_pb2.Tensor(shape=list(a.shape))
    t.data.extend(np.ascontiguousarray(a).ravel().tolist())
    return t


def _array(t: "heads_pb2.Tensor") -> np.ndarray:
    return np.asarray(t.data, dtype=np.float32).reshape(list(t.shape))


class Client:
    """A connection to ``heads serve``'s gRPC port.

    target: "host:port". root_certificates: PEM bytes of the CA (or self-signed certificate) to
    trust, which turns TLS on. timeout: default deadline of each call, in seconds (None: the
    server's default)."""

    def __init__(self, target: str = "127.0.0.1:50051", *, root_certificates: Optional[bytes] = None,
                 timeout: Optional[float] = None, max_message_mb: int = 64):
        options = [("grpc.max_receive_message_length", max_message_mb << 20),
                   ("grpc.max_send_message_length", max_message_mb << 20)]
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = heads_pb2_grpc.EmbedderStub(self._channel)
        self.timeout = timeout
        self.model_version: Optional[str] = None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _t(self, timeout):
        return self.timeout if timeout is None else timeout

    def embed(self, texts: Sequence[str] | str, *, timeout: Optional[float] = None) -> np.ndarray:
        """float32 [len(texts), dim] embeddings (a single string gives [1, dim])."""
        if isinstance(texts, str):
            texts = [texts]
        r = self._stub.Embed(heads_pb2.EmbedRequest(texts=list(texts)), timeout=self._t(timeout))
        self.model_version = r.model_version
        return self._rows(r)

    def embed_stream(self, texts: Iterable[str], *, chunk: int = 256,
                     timeout: Optional[float] = None) -> np.ndarray:
        """Embeddings of many texts through the streaming RPC: chunks of `chunk` texts go out while
        earlier chunks' results come back. Returns float32 [n, dim] in the order of `texts`.
        Raises RuntimeError if the server's model changed during the stream (a reload): the rows
        would come from two models; call again."""
        if chunk < 1:
            raise ValueError(f"chunk: expected a positive count, got {chunk}")

        def requests() -> Iterator["heads_pb2.EmbedRequest"]:
            batch = []
            for t in texts:
                batch.append(t)
                if len(batch) == chunk:
                    yield heads_pb2.EmbedRequest(texts=batch)
                    batch = []
            if batch:
                yield heads_pb2.EmbedRequest(texts=batch)

        parts, version = [], None
        call = self._stub.EmbedStream(requests(), timeout=self._t(timeout))
        try:
            for r in call:
                if version is not None and r.model_version != version:
                    raise RuntimeError(f"embed_stream: the server's model changed during the stream ({version}, "
                                       f"then {r.model_version}); call again")
                version = self.model_version = r.model_version
                if r.first_index != sum(len(p) for p in parts):
                    raise RuntimeError(f"embed_stream: chunk starting at {r.first_index} came out of order")
                parts.append(self._rows(r))
        except BaseException:
            call.cancel()  # stop sending `texts` and the server's work on them
            raise
        return np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)

    def tokenize(self, texts: Sequence[str] | str, *, timeout: Optional[float] = None) -> list:
        """Per text: {"ids": [...], "pieces": [...], "truncated": bool}."""
        if isinstance(texts, str):
            texts = [texts]
        r = self._stub.Tokenize(heads_pb2.TokenizeRequest(texts=list(texts)), timeout=self._t(timeout))
        self.model_version = r.model_version
        return [{"ids": list(t.ids), "pieces": list(t.pieces), "truncated": t.truncated} for t in r.texts]

    def attend(self, query, key=None, value=None, *, layer: int = 0, key_padding_mask=None,
               is_causal: bool = False, need_weights: bool = False, per_head_weights: bool = False,
               timeout: Optional[float] = None):
        """MultiheadAttention forward (eval) with the self-attention weights of the model's layer
        `layer`: query [N, L, E] or [L, E]; key/value default to the query; key_padding_mask [N, S]
        (true = padding). Returns (output, weights or None), float32 arrays."""
        req = heads_pb2.AttendRequest(layer=layer, query=_tensor(query, "query"), is_causal=is_causal,
                                      need_weights=need_weights, per_head_weights=per_head_weights)
        if (key is None) != (value is None):
            raise ValueError("key and value: give both or neither")
        if key is not None:
            req.key.CopyFrom(_tensor(key, "key"))
            req.value.CopyFrom(_tensor(value, "value"))
        if key_padding_mask is not None:
            req.key_padding_mask.CopyFrom(_tensor(np.asarray(key_padding_mask, dtype=np.float32), "key_padding_mask"))
        r = self._stub.Attend(req, timeout=self._t(timeout))
        self.model_version = r.model_version
        return _array(r.output), (_array(r.weights) if r.HasField("weights") else None)

    def rerank(self, query: str, texts: Sequence[str] | str, *, raw_scores: bool = False, return_text: bool = False,
               timeout: Optional[float] = None) -> list:
        """A reranker served: [{"index", "score"[, "text"]}], highest score first (ties in text
        order), as POST /rerank answers; score is the logit with raw_scores, else its sigmoid."""
        if isinstance(texts, str):
            texts = [texts]
        r = self._stub.Rerank(heads_pb2.RerankRequest(query=query, texts=list(texts), raw_scores=raw_scores,
                                                      return_text=return_text), timeout=self._t(timeout))
        self.model_version = r.model_version
        return [{"index": k.index, "score": k.score, **({"text": k.text} if return_text else {})} for k in r.ranks]

    def info(self, *, timeout: Optional[float] = None) -> dict:
        r = self._stub.Info(heads_pb2.InfoRequest(), timeout=self._t(timeout))
        return {"model_version": r.model_version, "model_name": r.model_name, "dtype": r.dtype, "dim": r.dim,
                "max_seq_length": r.max_seq_length, "num_layers": r.num_layers, "num_heads": r.num_heads}

    def health(self, service: str = "heads.v1.Embedder", *, timeout: Optional[float] = 5.0) -> bool:
        """True when the server's grpc.health.v1 service reports SERVING for `service`."""
        # HealthCheckRequest{service} and HealthCheckResponse{status} are one field each: encoded
        # here so that the client needs no grpcio-health-checking.
        name = service.encode()
        if len(name) > 127:
            raise ValueError(f"service: name of {len(name)} bytes is too long")
        check = self._channel.unary_unary("/grpc.health.v1.Health/Check",
                                          request_serializer=lambda b: b, response_deserializer=lambda b: b)
        reply = check(b"\n" + bytes([len(name)]) + name if name else b"", timeout=timeout)
        return reply == b"\x08\x01"  # status = SERVING (1)

    @staticmethod
    def _rows(r) -> np.ndarray:
        out = np.empty((len(r.embeddings), r.dim), dtype=np.float32)
        for i, e in enumerate(r.embeddings):
            out[i] = e.values
        return out
