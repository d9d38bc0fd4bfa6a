"""The model passes every criterion and the planner share: the units, batch preparation, switching a
unit's path, the loss, the cost meter and the hooks."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gnmr_hf.backends.base import DualPathModule, dual_path_modules
from gnmr_hf.backends.checkpoint import canonical_name
from gnmr_hf.rungs import get_rung
from gnmr_hf.units import UnitSpec, find_decoder_layers, resolve_units, short_name, unwrap_model

# ------------------------------------------------------------------------------------------ helpers


@dataclass
class _Unit:
    name: str
    module: nn.Module
    dual: list[nn.Module]  # dual-path modules inside the unit
    modules: list[str]
    bytes: int
    layer: int | None
    op: str


def _units(model: nn.Module, units: UnitSpec) -> list[_Unit]:

    resolved = resolve_units(model, units)
    base = unwrap_model(model)
    names = {id(m): canonical_name(n) for n, m in base.named_modules()}
    try:
        layer_of = {id(m): i for i, (_, layer) in enumerate(find_decoder_layers(model)) for m in layer.modules()}
    except ValueError:
        layer_of = {}
    out = []
    for name, unit in resolved:
        dual = list(dual_path_modules(unit))
        layers = [layer_of[id(m)] for m in dual if id(m) in layer_of]
        short = short_name(name)
        parts = short.split(".")
        op = parts[-1] if len(parts) > 2 else "layer"
        out.append(_Unit(name=short, module=unit, dual=dual, modules=[names.get(id(m), name) for m in dual],
                         bytes=sum(_bf16_bytes(m) for m in dual), layer=min(layers) if layers else None, op=op))
    if not any(u.dual for u in out):
        raise ValueError(
            f"the model holds no dual-path layer ({type(unwrap_model(model)).__name__}): load it quantised "
            "(BitsAndBytesConfig(load_in_4bit=True) or load_in_8bit=True) and call "
            "gnmr_hf.prepare_dual_path(model, recovery_source=checkpoint, units='linears') first"
        )
    return out


def _bf16_bytes(m: nn.Module) -> int:
    """A unit linear's price: its weight on the BF16 rung (the registry's bytes, as every price)."""
    out_f, in_f = getattr(m, "out_features", None), getattr(m, "in_features", None)
    if out_f is None or in_f is None:
        w = m._gnmr_source.stored if hasattr(m, "_gnmr_source") and m._gnmr_source.stored is not None else m.weight
        out_f, in_f = w.shape[0], w.shape[-1]
    return get_rung("bf16").bytes(int(out_f) * int(in_f), int(out_f)).total


def _keep_modules(model: nn.Module) -> list[str]:
    """What stock transformers keeps unquantised when ``llm_int8_skip_modules`` is not given."""
    base = unwrap_model(model)
    try:
        from transformers.quantizers.base import get_keys_to_not_convert

        keys = sorted(get_keys_to_not_convert(base))
    except Exception:  # another transformers version, or not a PreTrainedModel
        keys = []
    out_emb = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if out_emb is not None:
        name = next((n for n, m in base.named_modules() if m is out_emb), None)
        if name and name not in keys:
            keys.append(name)
    return keys


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _prepare_batches(model: nn.Module, batches: Iterable[Mapping[str, Any]] | Mapping[str, Any]
                     ) -> tuple[list[dict[str, Any]], list[int]]:
    """Batches on the model's device with labels (padding -100), and each batch's target-token count.

    A batch is any mapping with ``input_ids`` (a dict, a ``BatchEncoding`` from a tokenizer or a transformers
    collator); ``batches`` is any iterable of them (a list, a ``torch.utils.data.DataLoader``: iterated once
    here), or one mapping (one batch)."""
    device = _device(model)
    if isinstance(batches, Mapping):
        batches = [batches]
    elif isinstance(batches, (str, bytes, torch.Tensor)) or not isinstance(batches, Iterable):
        raise ValueError(f"batches must be a list (or DataLoader) of batches, each a mapping with input_ids; got "
                         f"{type(batches).__name__}")
    out, counts = [], []
    for i, b in enumerate(batches):
        if not isinstance(b, Mapping) or "input_ids" not in b:
            got = type(b).__name__ if not isinstance(b, Mapping) else f"keys {sorted(map(str, b))}"
            raise ValueError(f"batch {i} must be a mapping (dict, BatchEncoding) with input_ids (and attention_mask, "
                             f"labels); got {got}")
        b = {k: (torch.as_tensor(v) if isinstance(v, (list, tuple)) else v) for k, v in dict(b).items()}
        b = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
        if b["input_ids"].dim() == 1:
            b = {k: (v.unsqueeze(0) if isinstance(v, torch.Tensor) and v.dim() == 1 else v) for k, v in b.items()}
        if "labels" not in b:
            labels = b["input_ids"].clone()
            if "attention_mask" in b:
                labels[b["attention_mask"] == 0] = -100
            b["labels"] = labels
        n = int((b["labels"][..., 1:] != -100).sum())
        if n == 0:
            raise ValueError(f"batch {i} has no target token (every label is -100)")
        b.setdefault("use_cache", False)
        out.append(b)
        counts.append(n)
    if not out:
        raise ValueError("batches is empty: give at least one batch of training data")
    return out, counts


def _batch_digest(batch: dict[str, Any]) -> str:
    """A short fingerprint of a prepared batch's ``input_ids``, ``labels`` and ``attention_mask``: which data it is."""
    import hashlib

    h = hashlib.sha256()
    for key in ("input_ids", "labels", "attention_mask"):
        v = batch.get(key)
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu", torch.int64).contiguous()
            h.update(f"{key}{tuple(t.shape)}".encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


#: the chunked loss computes at most this many logits at once (16 Mi: 64 MiB in FP32), and at most
#: :data:`LOSS_CHUNK_ROWS` positions: on Gemma 3's 262k-word vocabulary, 64 positions a chunk
LOSS_CHUNK_ELEMENTS = 2**24
LOSS_CHUNK_ROWS = 512


def _loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The batch's causal-LM loss (the mean over its target tokens), as ``model(**batch).loss`` computes it.

    Why not that call: it holds the full-vocabulary logits of every position of the batch at once, and in a
    backward also their log-softmax and gradient (Gemma 3's 262k words at 2 x 512 tokens: 1 GiB each in
    FP32), more than a training step of the same model needs besides. So for a transformers ``*ForCausalLM``
    with the stock loss (``ForCausalLMLoss``), the decoder runs alone and the head's logits are formed only at
    the positions with a target, :func:`chunked_causal_lm_loss` at a time. Any other model: its own loss."""
    parts = _head_parts(model)
    if parts is None:
        return model(**batch).loss
    decoder, head, softcap = parts
    labels = batch["labels"]
    hidden = decoder(**{k: v for k, v in batch.items() if k != "labels"})[0]
    return chunked_causal_lm_loss(hidden, labels, head, softcap)


def chunked_causal_lm_loss(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module,
                           softcap: float | None = None, rows: int | None = None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` of ``head(hidden)`` without forming all the logits at once.

    ``hidden`` [batch, seq, hidden] are the decoder's final hidden states, ``labels`` [batch, seq] the
    unshifted labels (-100: no target). Position t predicts ``labels[t + 1]``; only positions with a target
    reach the head, ``rows`` of them at a time (default: :data:`LOSS_CHUNK_ROWS`, fewer where the vocabulary
    would make a chunk's logits exceed :data:`LOSS_CHUNK_ELEMENTS`). Each chunk's logits, softcapped as
    Gemma's ``final_logit_softcapping`` does, are up-cast to FP32 for the cross-entropy, as the stock loss
    does. When a gradient is wanted, each chunk is checkpointed (``torch.utils.checkpoint``): the backward
    recomputes its logits, so at most one chunk's logits (and their gradient) exist at a time. Returns the
    sum of the chunks' token losses over the target count (0-d FP32), equal to the stock loss within
    rounding."""
    targets = labels[..., 1:]
    keep = targets != -100
    h = hidden[..., :-1, :][keep]  # [n, hidden]: the positions with a target, in order
    y = targets[keep]
    n = y.numel()
    if n == 0:
        raise ValueError("the batch has no target token (every label is -100)")
    vocab = int(getattr(head, "out_features", 0) or head.weight.shape[0])
    if rows is None:
        rows = max(1, min(LOSS_CHUNK_ROWS, LOSS_CHUNK_ELEMENTS // max(vocab, 1)))
    grad = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in head.parameters()))
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, n, rows):
        hc, yc = h[start:start + rows], y[start:start + rows]
        if grad:
            from torch.utils.checkpoint import checkpoint

            part = checkpoint(_chunk_nll, head, softcap, hc, yc, use_reentrant=False)
        else:
            part = _chunk_nll(head, softcap, hc, yc)
        total = total + part
    return total / n


def _chunk_nll(head: nn.Module, softcap: float | None, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = head(h)  # [rows, vocab]
    if softcap is not None:  # as Gemma's forward applies final_logit_softcapping, in the logits' dtype
        logits = torch.tanh(logits / softcap) * softcap
    return torch.nn.functional.cross_entropy(logits.float(), y, ignore_index=-100, reduction="sum")


def _head_parts(model: nn.Module) -> tuple[nn.Module, nn.Module, float | None] | None:
    """``(decoder, lm_head, final_logit_softcapping)`` when ``model``'s loss is transformers' stock causal-LM
    loss over ``lm_head(decoder(...)[0])``, else None (the model's own forward then computes the loss)."""
    base = unwrap_model(model)
    if not type(base).__name__.endswith("ForCausalLM"):
        return None
    if any(getattr(c, "is_prompt_learning", False) for c in (getattr(model, "peft_config", None) or {}).values()):
        return None  # PEFT's prompt learning rewrites the inputs in PeftModel.forward
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss

        if base.loss_function is not ForCausalLMLoss:
            return None
        decoder, head = base.get_decoder(), base.get_output_embeddings()
    except (ImportError, AttributeError, ValueError):
        return None
    if decoder is None or decoder is base or not isinstance(head, nn.Module) or getattr(head, "weight", None) is None:
        return None
    # a criterion's hook on a dual-path head expects one call on every position; a checkpointed chunk calls twice
    if any(isinstance(m, DualPathModule) or m._forward_hooks or m._forward_pre_hooks for m in head.modules()):
        return None
    if base._forward_hooks or base._forward_pre_hooks:
        return None  # the model's own forward would run them
    return decoder, head, getattr(getattr(base, "config", None), "final_logit_softcapping", None)


def _set_path(units: list[_Unit], high: Iterable[int]) -> None:
    high = set(high)
    for i, u in enumerate(units):
        for m in u.dual:
            if m.recovery != (i in high):
                m.set_recovery(i in high)


class _Meter:
    """Wall seconds, process CPU seconds (all threads; on a busy machine the steadier figure) and peak
    memory increase of a block (CUDA allocator on a GPU, else sampled process RSS)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = 0.0
        self.peak = None
        self.kind = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                     else "process RSS growth, sampled every 5 ms after returning freed heap to the OS")

    def __enter__(self) -> _Meter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _trim_heap()  # memory freed by earlier passes goes back to the OS, so RSS growth is this block's
            self._start = _rss()
            self._max = self._start
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        self._t0 = time.perf_counter()
        self._c0 = time.process_time()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            r = _rss()
            if r is not None and (self._max is None or r > self._max):
                self._max = r

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._c0
        if self.device.type == "cuda":
            self.peak = int(torch.cuda.max_memory_allocated(self.device) - self._start)
        else:
            self._stop.set()
            self._thread.join()
            r = _rss()
            if r is not None and self._max is not None:
                self._max = max(self._max, r)
            self.peak = None if self._start is None else int(self._max - self._start)


def _trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: return freed heap pages to the OS (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _cost(meter: _Meter, forwards: int, backwards: int, note: str = "") -> dict[str, Any]:
    out = {"seconds": meter.seconds, "cpu_seconds": meter.cpu_seconds, "forwards": forwards, "backwards": backwards, "peak_mem_bytes": meter.peak,
           "mem_kind": meter.kind}
    if note:
        out["note"] = note
    return out


def _progress(it: Iterable, total: int, desc: str, on: bool) -> Iterable:
    if not on:
        return it
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return it
    return tqdm(it, total=total, desc=desc, leave=False)


@contextlib.contextmanager
def _input_grad(model: nn.Module) -> Iterator[None]:
    """Freeze every parameter and make the input embeddings' output require grad, so a backward reaches
    every layer's output without forming any weight gradient."""
    base = unwrap_model(model)
    emb = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    if emb is None:
        raise ValueError("first_order needs the model's input embeddings (get_input_embeddings())")
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    handle = emb.register_forward_hook(lambda mod, inp, out: out.requires_grad_(True))
    try:
        yield
    finally:
        handle.remove()
        for p, flag in flags:
            p.requires_grad_(flag)


def _high_output(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's recovery-path output on ``x`` (its forward called directly: no hooks run)."""
    was = m.recovery
    if not was:
        m.set_recovery(True)
    try:
        return m.forward(x)
    finally:
        if not was:
            m.set_recovery(False)


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, tuple):
        return type(x)(*(_clone(v) for v in x)) if hasattr(x, "_fields") else tuple(_clone(v) for v in x)
    return x


@contextlib.contextmanager
def _skip_layers(layers: list[nn.Module], below: int, cache: dict[int, Any]) -> Iterator[None]:
    """Layers ``0 .. below-1`` return their cached output instead of computing."""
    saved = []
    for i in range(below):
        layer = layers[i]
        saved.append((layer, layer.__dict__.get("forward")))
        layer.forward = (lambda out: (lambda *a, **k: _clone(out)))(cache[i])
    try:
        yield
    finally:
        for layer, fwd in saved:
            if fwd is None:
                del layer.forward
            else:
                layer.forward = fwd


