"""Generator backends for synthetic data: a local ``transformers`` model or an HTTP endpoint.

Every backend implements one method (:class:`Backend`)::

    generate(prompts, n, temperature, max_new_tokens, seed) -> list[list[str]]

returning, for each prompt, ``n`` completions (the generated text only, without the prompt).
``temperature == 0`` means greedy decoding (the ``n`` completions are then identical).

A completion that could not be produced is a :class:`Failed`: an *empty* ``str`` that carries the
reason (:attr:`Rejection.TIMEOUT`, :attr:`Rejection.BACKEND_ERROR`, :attr:`Rejection.TOO_LONG`
for a prompt that does not fit the model's context) and a detail. Callers that only want text see
an empty string; :mod:`fedcompress.synth.generate` counts it under its own reason. A backend
never raises for one bad request: HTTP errors, malformed responses, timeouts and exceptions
inside ``model.generate`` all become :class:`Failed` completions of the prompts concerned.

* :class:`HFBackend`: a causal LM in this process (``transformers``), batched generation with
  left padding, seeded sampling, any device/dtype; :meth:`HFBackend.load` goes through
  :func:`~fedcompress.models.loading.load_model` (embedded names such as ``smollm2-135m``, local
  directories, ``.gguf`` files). Prompts go through the tokenizer's chat template when it has
  one (instruct models), else as plain text (:func:`fedcompress.synth.prompts.render_prompt`).
* :class:`OpenAIBackend`: an OpenAI-compatible server (vLLM, Ollama, TGI, llama.cpp server, ...),
  ``/v1/chat/completions`` or ``/v1/completions``, with the standard library only (``urllib``),
  an API key read from an environment variable, a timeout, retries with exponential backoff and a
  few requests in flight at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from fedcompress.synth.parse import Rejection
from fedcompress.synth.prompts import Prompt, as_messages, render_prompt

__all__ = [
    "Backend",
    "Failed",
    "HFBackend",
    "OpenAIBackend",
]

logger = logging.getLogger(__name__)


class Failed(str):
    """A completion that failed: an empty string with ``reason`` (a :class:`Rejection`) and
    ``detail`` (a short explanation)."""

    reason: Rejection
    detail: str

    def __new__(cls, reason: Rejection | str, detail: str = "") -> Failed:
        obj = super().__new__(cls, "")
        obj.reason = Rejection(reason)
        obj.detail = detail
        return obj

    def __repr__(self) -> str:
        return f"Failed({self.reason.value!r}, {self.detail!r})"

    def __reduce__(self):  # pickling (e.g. across processes) keeps the reason
        return (Failed, (self.reason.value, self.detail))


@runtime_checkable
class Backend(Protocol):
    """What the synthetic-data pipeline needs from a generator model."""

    name: str

    def generate(self, prompts: Sequence[Prompt], n: int, temperature: float,
                 max_new_tokens: int, seed: int) -> list[list[str]]:
        """``n`` completions for each prompt (failures as :class:`Failed`), seeded by ``seed``."""
        ...


def _check_args(n: int, temperature: float, max_new_tokens: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


# ---------------------------------------------------------------------------------------------
# Local transformers model
# ---------------------------------------------------------------------------------------------


class HFBackend:
    """A local causal LM (``transformers``): batched, left-padded, seeded generation.

    Args:
        model: A causal LM (already on its device, in eval mode).
        tokenizer: Its tokenizer.
        batch_size: Prompts per ``model.generate`` call (each with ``n`` sequences, so
            ``batch_size * n`` rows). Prompts are sorted by length before batching (less padding)
            and the results returned in the caller's order.
        chat_template: ``None``: the tokenizer's chat template when it has one; ``True``/``False``:
            force it on/off (see :func:`~fedcompress.synth.prompts.render_prompt`).
        top_p: Nucleus sampling threshold when sampling (1.0: off).
        top_k: Top-k when sampling (0: off; ``None``: the model's generation config).
        max_time: Seconds after which one ``generate`` call stops; its unfinished sequences (no
            end-of-sequence token yet) become :class:`Failed` ``timeout`` (``None``: no limit).
        name: Name used in reports (default: the model's ``name_or_path``).

    Seeding: the batches of one call use seeds ``seed, seed + 1, ...`` in (length-sorted) batch
    order, set on torch's generators inside :func:`torch.random.fork_rng`, so the caller's random
    state is untouched and the same prompts, settings and seed give the same completions on the
    same hardware.
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 8,
                 chat_template: bool | None = None, top_p: float = 1.0, top_k: int | None = 0,
                 max_time: float | None = None, name: str | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.chat_template = chat_template
        self.top_p = top_p
        self.top_k = top_k
        self.max_time = max_time
        self.name = name or str(getattr(model.config, "name_or_path", "")
                                or model.config.model_type)
        self.stats: dict[str, float] = {"calls": 0, "prompts": 0, "sequences": 0,
                                        "new_tokens": 0, "seconds": 0.0, "failures": 0}
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        self._eos: set[int] = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self._pad = tokenizer.pad_token_id
        if self._pad is None:
            self._pad = next(iter(sorted(self._eos)), 0)

    @classmethod
    def load(cls, spec: str, *, device: str | torch.device | None = None,
             dtype: str | torch.dtype | None = None, **kwargs: Any) -> HFBackend:
        """Load ``spec`` with :func:`~fedcompress.models.loading.load_model` and wrap it."""
        from fedcompress.models import load_model

        loaded = load_model(spec, device=device, dtype=dtype)
        kwargs.setdefault("name", spec)
        return cls(loaded.model, loaded.tokenizer, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def render(self, prompt: Prompt) -> str:
        """The text the model continues for ``prompt``."""
        return render_prompt(prompt, self.tokenizer, self.chat_template)

    def generate(self, prompts: Sequence[Prompt], n: int, temperature: float,
                 max_new_tokens: int, seed: int) -> list[list[str]]:
        """See :class:`Backend`; the class docstring describes batching and seeding."""
        from fedcompress.models import model_context_length

        _check_args(n, temperature, max_new_tokens)
        start = time.perf_counter()
        out: list[list[str]] = [[] for _ in prompts]
        encoded: dict[int, list[int]] = {}
        context = model_context_length(self.model)
        for i, prompt in enumerate(prompts):
            try:
                text = self.render(prompt)
                ids = self.tokenizer(text, add_special_tokens=not self._templated())["input_ids"]
            except Exception as err:  # a broken prompt or template: this prompt only
                out[i] = [Failed(Rejection.BACKEND_ERROR, f"prompt: {err}")] * n
                continue
            if context is not None and len(ids) + max_new_tokens > context:
                out[i] = [Failed(Rejection.TOO_LONG, f"prompt of {len(ids)} tokens + "
                                 f"{max_new_tokens} new > context {context}")] * n
                continue
            encoded[i] = list(ids)
        order = sorted(encoded, key=lambda i: (len(encoded[i]), i))
        batches = [order[b:b + self.batch_size] for b in range(0, len(order), self.batch_size)]
        for b, batch in enumerate(batches):
            try:
                texts = self._generate_batch([encoded[i] for i in batch], n, temperature,
                                             max_new_tokens, seed + b)
            except Exception as err:  # e.g. out of memory: the prompts of this batch only
                logger.warning("generation failed for a batch of %d prompts: %s", len(batch), err)
                texts = [[Failed(Rejection.BACKEND_ERROR, f"{type(err).__name__}: {err}")] * n
                         for _ in batch]
            for i, completions in zip(batch, texts):
                out[i] = completions
        self.stats["calls"] += 1
        self.stats["prompts"] += len(prompts)
        self.stats["failures"] += sum(isinstance(c, Failed) for row in out for c in row)
        self.stats["seconds"] += time.perf_counter() - start
        return out

    def _templated(self) -> bool:
        from fedcompress.synth.prompts import has_chat_template

        if self.chat_template is None:
            return has_chat_template(self.tokenizer)
        return self.chat_template

    def _generate_batch(self, rows: list[list[int]], n: int, temperature: float,
                        max_new_tokens: int, seed: int) -> list[list[str]]:
        device = self.device
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self._pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for j, row in enumerate(rows):  # left padding: the prompts end where generation starts
            input_ids[j, width - len(row):] = torch.tensor(row, dtype=torch.long)
            attention[j, width - len(row):] = 1
        sample = temperature > 0
        kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=sample,
                                      pad_token_id=self._pad,
                                      num_return_sequences=n if sample else 1)
        if sample:
            kwargs.update(temperature=float(temperature), top_p=self.top_p)
            if self.top_k is not None:
                kwargs["top_k"] = self.top_k
        else:  # explicit greedy: override sampling defaults of the model's generation config
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if self.max_time is not None:
            kwargs["max_time"] = self.max_time
        devices = [device] if device.type == "cuda" else []
        started = time.perf_counter()
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed)
            generated = self.model.generate(input_ids=input_ids.to(device),
                                            attention_mask=attention.to(device), **kwargs)
        timed_out = self.max_time is not None and time.perf_counter() - started >= self.max_time
        new = generated[:, width:].cpu()
        per_prompt = n if sample else 1
        results: list[list[str]] = []
        for j in range(len(rows)):
            completions: list[str] = []
            for k in range(per_prompt):
                tokens = new[j * per_prompt + k].tolist()
                finished = any(t in self._eos for t in tokens)
                if finished:
                    tokens = tokens[:next(p for p, t in enumerate(tokens) if t in self._eos)]
                self.stats["new_tokens"] += len(tokens)
                if timed_out and not finished:
                    completions.append(Failed(Rejection.TIMEOUT,
                                              f"generation stopped after {self.max_time:g} s"))
                else:
                    completions.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
            results.append(completions if sample else completions * n)
        self.stats["sequences"] += len(rows) * per_prompt
        return results


# ---------------------------------------------------------------------------------------------
# OpenAI-compatible HTTP endpoint
# ---------------------------------------------------------------------------------------------


class _RequestFailed(Exception):
    def __init__(self, reason: Rejection, detail: str, retry: bool) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.retry = reason, detail, retry


class OpenAIBackend:
    """An OpenAI-compatible completion server, over HTTP with the standard library.

    Args:
        base_url: The server's API root, e.g. ``http://localhost:8000/v1`` (vLLM),
            ``http://localhost:11434/v1`` (Ollama), ``http://localhost:8080/v1`` (TGI,
            llama.cpp); ``/v1`` is appended when the URL does not end with it.
        model: The model name the server knows.
        api: ``"chat"`` (``/chat/completions``, messages; the server applies the chat template)
            or ``"completions"`` (``/completions``; the prompt is rendered as plain text).
        api_key_env: Environment variable holding the API key, sent as ``Authorization:
            Bearer``; no header when it is unset (local servers need none).
        timeout: Seconds to wait for one HTTP response.
        retries: Extra attempts after a timeout, a connection error, HTTP 408/429 or 5xx, with
            sleeps of ``backoff * 2**attempt`` seconds in between. Other HTTP errors and
            malformed responses are not retried.
        backoff: First sleep between attempts, in seconds.
        max_workers: Requests in flight at once (one request per prompt).
        use_n: Ask for all ``n`` completions in one request (``"n": n``). Servers that return
            fewer choices (some ignore ``n``) are topped up with further requests.
        top_p: Sent when not ``None``.
        stop: Stop strings, sent when given.
        extra_body: Further JSON fields merged into every request.
        name: Name used in reports (default: ``model``).

    Seeding: the ``i``-th prompt of a call is sent with ``"seed": seed + i`` (top-up requests
    add ``1_000_003 * k``); servers that honour ``seed`` then repeat their output.
    """

    def __init__(self, base_url: str, model: str, *, api: str = "chat",
                 api_key_env: str | None = "OPENAI_API_KEY", timeout: float = 60.0,
                 retries: int = 2, backoff: float = 1.0, max_workers: int = 4,
                 use_n: bool = True, top_p: float | None = None,
                 stop: Sequence[str] | None = None, extra_body: dict[str, Any] | None = None,
                 name: str | None = None) -> None:
        if api not in ("chat", "completions"):
            raise ValueError(f"api must be 'chat' or 'completions', got {api!r}")
        if retries < 0 or timeout <= 0 or max_workers < 1 or backoff < 0:
            raise ValueError("retries and backoff must be >= 0, timeout > 0, max_workers >= 1")
        root = base_url.rstrip("/")
        if not root.endswith("/v1"):
            root += "/v1"
        self.url = root + ("/chat/completions" if api == "chat" else "/completions")
        self.model = model
        self.api = api
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_workers = max_workers
        self.use_n = use_n
        self.top_p = top_p
        self.stop = list(stop) if stop else None
        self.extra_body = dict(extra_body or {})
        self.name = name or model
        self._api_key = os.environ.get(api_key_env) if api_key_env else None
        self.stats: dict[str, float] = {"calls": 0, "prompts": 0, "requests": 0, "retries": 0,
                                        "failures": 0, "completion_tokens": 0, "seconds": 0.0}
        self._lock = threading.Lock()

    def _count(self, key: str, value: float = 1) -> None:
        with self._lock:  # requests run in worker threads
            self.stats[key] += value

    def generate(self, prompts: Sequence[Prompt], n: int, temperature: float,
                 max_new_tokens: int, seed: int) -> list[list[str]]:
        """See :class:`Backend`; one request (or more, to top up ``n``) per prompt."""
        _check_args(n, temperature, max_new_tokens)
        start = time.perf_counter()
        jobs = [(prompt, n, temperature, max_new_tokens, seed + i)
                for i, prompt in enumerate(prompts)]
        if self.max_workers == 1 or len(jobs) <= 1:
            out = [self._complete(*job) for job in jobs]
        else:
            with concurrent.futures.ThreadPoolExecutor(self.max_workers) as pool:
                out = list(pool.map(lambda job: self._complete(*job), jobs))
        self.stats["calls"] += 1
        self.stats["prompts"] += len(prompts)
        self.stats["failures"] += sum(isinstance(c, Failed) for row in out for c in row)
        self.stats["seconds"] += time.perf_counter() - start
        return out

    def _complete(self, prompt: Prompt, n: int, temperature: float, max_new_tokens: int,
                  seed: int) -> list[str]:
        """``n`` completions of one prompt; failures become :class:`Failed`."""
        texts: list[str] = []
        k = 0
        while len(texts) < n:
            want = n - len(texts) if self.use_n else 1
            try:
                got = self._request(prompt, want, temperature, max_new_tokens,
                                    seed + 1_000_003 * k)
            except _RequestFailed as err:
                logger.warning("request to %s failed (%s): %s", self.url, err.reason.value,
                               err.detail)
                return texts + [Failed(err.reason, err.detail)] * (n - len(texts))
            texts.extend(got[:n - len(texts)])
            k += 1
        return texts

    def _body(self, prompt: Prompt, n: int, temperature: float, max_new_tokens: int,
              seed: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model}
        if self.api == "chat":
            body["messages"] = as_messages(prompt)
        else:
            body["prompt"] = render_prompt(prompt, chat_template=False)
        body.update(n=n, temperature=float(temperature), max_tokens=max_new_tokens, seed=seed)
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if self.stop:
            body["stop"] = self.stop
        body.update(self.extra_body)
        return body

    def _request(self, prompt: Prompt, n: int, temperature: float, max_new_tokens: int,
                 seed: int) -> list[str]:
        """One completion request with retries; raises :class:`_RequestFailed`."""
        data = json.dumps(self._body(prompt, n, temperature, max_new_tokens, seed)).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        for attempt in range(self.retries + 1):
            if attempt:
                self._count("retries")
                time.sleep(self.backoff * 2 ** (attempt - 1))
            self._count("requests")
            try:
                payload = self._post(data, headers)
                return self._texts(payload)
            except _RequestFailed as err:
                if not err.retry or attempt == self.retries:
                    raise
                logger.info("retrying %s after %s (%s)", self.url, err.reason.value, err.detail)
        raise AssertionError("unreachable")

    def _post(self, data: bytes, headers: dict[str, str]) -> Any:
        request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            body = ""
            with contextlib.suppress(Exception):
                body = err.read()[:200].decode("utf-8", "replace")
            detail = f"HTTP {err.code}: {body}".strip()
            raise _RequestFailed(Rejection.BACKEND_ERROR, detail,
                                 retry=err.code in (408, 429) or err.code >= 500) from None
        except (TimeoutError, socket.timeout) as err:
            raise _RequestFailed(Rejection.TIMEOUT, f"no response in {self.timeout:g} s",
                                 retry=True) from err
        except urllib.error.URLError as err:
            if isinstance(err.reason, (TimeoutError, socket.timeout)):
                raise _RequestFailed(Rejection.TIMEOUT, f"no response in {self.timeout:g} s",
                                     retry=True) from err
            raise _RequestFailed(Rejection.BACKEND_ERROR, f"connection: {err.reason}",
                                 retry=True) from err
        except (OSError, ValueError) as err:  # reset connections, bad status lines, ...
            raise _RequestFailed(Rejection.BACKEND_ERROR, f"{type(err).__name__}: {err}",
                                 retry=True) from err
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise _RequestFailed(Rejection.BACKEND_ERROR,
                                 f"malformed JSON: {raw[:80]!r}", retry=False) from err

    def _texts(self, payload: Any) -> list[str]:
        """The completion texts of a response, in ``index`` order."""
        try:
            choices = payload["choices"]
            if not isinstance(choices, list) or not choices:
                raise TypeError("no choices")
            choices = sorted(choices, key=lambda c: c.get("index", 0))
            if self.api == "chat":
                texts = [c["message"].get("content") or "" for c in choices]
            else:
                texts = [c.get("text") or "" for c in choices]
            if not all(isinstance(t, str) for t in texts):
                raise TypeError("non-string content")
        except (KeyError, TypeError, AttributeError, IndexError) as err:
            raise _RequestFailed(Rejection.BACKEND_ERROR,
                                 f"unexpected response shape ({err}): {str(payload)[:80]}",
                                 retry=False) from None
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self._count("completion_tokens", usage["completion_tokens"])
        return texts
