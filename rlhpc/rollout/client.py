"""HTTP client for one rollout engine: SGLang's native routes, SGLang's field names.

The same client drives a real SGLang server (GPU clusters) and ``rlhpc.rollout.cpu_server``
(CPU machines, CI). Every request body is built by one ``*_payload`` function per route, so the
field names can be checked against SGLang's ``io_struct.py`` in one place (tests do).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import requests

from rlhpc.errors import RlhpcError

log = logging.getLogger(__name__)


class EngineUnavailable(RlhpcError):
    """The engine did not answer (connection refused/reset, timeout) or answered 5xx: it may be dead."""


# ------------------------------------------------------------------ request bodies (one per route)


def generate_payload(
    input_ids: list[int] | list[list[int]] | None = None,
    text: str | list[str] | None = None,
    sampling_params: dict | list[dict] | None = None,
    return_logprob: bool | list[bool] = False,
    rid: str | list[str] | None = None,
) -> dict[str, Any]:
    """GenerateReqInput: exactly one of input_ids / text; single prompt or a batch."""
    if (input_ids is None) == (text is None):
        raise RlhpcError("generate needs exactly one of input_ids and text", "pass token ids or a prompt string")
    body: dict[str, Any] = {"input_ids": input_ids} if input_ids is not None else {"text": text}
    body["sampling_params"] = sampling_params if sampling_params is not None else {}
    body["return_logprob"] = return_logprob
    if rid is not None:
        body["rid"] = rid
    return body


def pause_generation_payload(mode: str = "abort") -> dict[str, Any]:
    """PauseGenerationReqInput (mode: abort | retract | in_place); older SGLang ignores the body."""
    return {"mode": mode}


def abort_request_payload(rid: str = "", abort_all: bool = False) -> dict[str, Any]:
    """AbortReq."""
    return {"rid": rid, "abort_all": abort_all}


def init_weights_update_group_payload(
    master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> dict[str, Any]:
    """InitWeightsUpdateGroupReqInput."""
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def destroy_weights_update_group_payload(group_name: str) -> dict[str, Any]:
    """DestroyWeightsUpdateGroupReqInput."""
    return {"group_name": group_name}


def update_weights_from_distributed_payload(
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    group_name: str,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    weight_version: str | None = None,
) -> dict[str, Any]:
    """UpdateWeightsFromDistributedReqInput (dtypes as torch attribute names: "float32", "bfloat16")."""
    return {
        "names": names,
        "dtypes": dtypes,
        "shapes": shapes,
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
        "weight_version": weight_version,
    }


def update_weights_from_tensor_payload(
    serialized_named_tensors: list[str],
    load_format: str | None = None,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    weight_version: str | None = None,
) -> dict[str, Any]:
    """UpdateWeightsFromTensorReqInput (one base64 entry per TP rank)."""
    return {
        "serialized_named_tensors": serialized_named_tensors,
        "load_format": load_format,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
        "weight_version": weight_version,
    }


def memory_occupation_payload(tags: list[str] | None = None) -> dict[str, Any]:
    """Release/ResumeMemoryOccupationReqInput (tags: "weights", "kv_cache"; None = all)."""
    return {"tags": tags}


def get_weights_by_name_payload(name: str, truncate_size: int = 100) -> dict[str, Any]:
    """GetWeightsByNameReqInput."""
    return {"name": name, "truncate_size": truncate_size}


# ------------------------------------------------------------------ client


class EngineClient:
    """One engine's HTTP API. Methods raise RlhpcError on connection failure, non-200 or success=false."""

    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._session = requests.Session()

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    # -------------------------------------------------------------- plumbing

    def _request(
        self, method: str, route: str, body: Any = None, timeout_s: float | None = None, send_body: bool = True
    ) -> requests.Response:
        url = f"{self.base_url}{route}"
        try:
            kwargs: dict[str, Any] = {"timeout": timeout_s or self.timeout_s}
            if send_body and body is not None:
                kwargs["json"] = body
            resp = self._session.request(method, url, **kwargs)
        except requests.RequestException as e:
            raise EngineUnavailable(
                f"engine {self.base_url} unreachable on {route}: {type(e).__name__}: {e}",
                "check that the engine server is running (its log names the reason it stopped)",
            ) from e
        if resp.status_code >= 500:  # SGLang answers 5xx when its scheduler died or is shutting down
            raise EngineUnavailable(
                f"engine {self.base_url}{route} answered HTTP {resp.status_code}: {_error_text(resp)}",
                "see the engine log: the server may have crashed",
            )
        if resp.status_code != 200:
            raise RlhpcError(
                f"engine {self.base_url}{route} answered HTTP {resp.status_code}: {_error_text(resp)}",
                "see the message above and the engine log",
            )
        return resp

    def _json(self, method: str, route: str, body: Any = None, timeout_s: float | None = None) -> Any:
        resp = self._request(method, route, body, timeout_s)
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text

    def _checked(self, route: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """POST to a route answering {"success", "message"}; raise on success=false."""
        out = self._json("POST", route, body, timeout_s)
        if not isinstance(out, dict) or not out.get("success", False):
            raise RlhpcError(f"engine {self.base_url}{route} failed: {out}", "see the message above and the engine log")
        return out

    # -------------------------------------------------------------- health and info

    def health(self, timeout_s: float = 5.0) -> bool:
        """True when /health answers 200 (False, not an error, when unreachable)."""
        try:
            return self._session.get(f"{self.base_url}/health", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def health_generate(self, timeout_s: float = 60.0) -> bool:
        try:
            return self._session.get(f"{self.base_url}/health_generate", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(self, deadline_s: float, poll_s: float = 0.2) -> None:
        """Block until /health answers 200, for at most ``deadline_s`` seconds from now."""
        end = time.monotonic() + deadline_s
        while not self.health(timeout_s=max(0.5, min(5.0, end - time.monotonic()))):
            if time.monotonic() >= end:
                raise RlhpcError(
                    f"engine {self.base_url} not healthy after {deadline_s:.0f}s",
                    "check the engine log; raise the startup timeout for large models",
                )
            time.sleep(poll_s)

    def get_model_info(self) -> dict[str, Any]:
        return self._json("GET", "/get_model_info")

    def get_server_info(self) -> dict[str, Any]:
        """/server_info on recent SGLang, /get_server_info (deprecated there) on older ones."""
        try:
            return self._json("GET", "/server_info")
        except RlhpcError as e:
            if "HTTP 404" not in e.problem:
                raise
        return self._json("GET", "/get_server_info")

    def get_weight_version(self) -> str:
        return self._json("GET", "/get_weight_version")["weight_version"]

    # -------------------------------------------------------------- generation

    def generate(
        self,
        input_ids: list[int] | list[list[int]] | None = None,
        text: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        return_logprob: bool | list[bool] = False,
        rid: str | list[str] | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """One dict for a single prompt, a list for a batch (as SGLang answers)."""
        body = generate_payload(input_ids, text, sampling_params, return_logprob, rid)
        return self._json("POST", "/generate", body, timeout_s)

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache")  # no body; 400 while requests are pending

    def pause_generation(self, mode: str = "abort") -> None:
        self._json("POST", "/pause_generation", pause_generation_payload(mode))

    def continue_generation(self) -> None:
        self._json("POST", "/continue_generation", {})

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self._request("POST", "/abort_request", abort_request_payload(rid, abort_all))

    # -------------------------------------------------------------- weights

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> dict[str, Any]:
        body = init_weights_update_group_payload(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )
        return self._checked("/init_weights_update_group", body)

    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return self._checked("/destroy_weights_update_group", destroy_weights_update_group_payload(group_name))

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        body = update_weights_from_distributed_payload(
            names, dtypes, shapes, group_name, flush_cache, abort_all_requests, weight_version
        )
        return self._checked("/update_weights_from_distributed", body)

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        body = update_weights_from_tensor_payload(
            serialized_named_tensors, load_format, flush_cache, abort_all_requests, weight_version
        )
        return self._checked("/update_weights_from_tensor", body)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self._json("POST", "/get_weights_by_name", get_weights_by_name_payload(name, truncate_size))

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._json("POST", "/release_memory_occupation", memory_occupation_payload(tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._json("POST", "/resume_memory_occupation", memory_occupation_payload(tags))

    def close(self) -> None:
        self._session.close()


def _error_text(resp: requests.Response) -> str:
    """SGLang's error bodies: {"error": {"message"}}, {"message"}, {"detail"} or plain text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:2000]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
    return str(body)[:2000]
