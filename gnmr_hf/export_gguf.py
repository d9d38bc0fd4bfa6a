"""A plan as one GGUF file for llama.cpp: each planned linear at its rung's GGUF type (gnmr_hf.export_gguf).

``export_gguf(model, plan, output)`` writes the model (a LoRA adapter merged into its BF16 weights first, when
given) as llama.cpp's converter (``convert_hf_to_gguf.py``) writes it, with one difference: each decoder linear
gets the GGUF type of its rung (``low`` -> ``Q4_0`` by default, ``int8`` -> ``Q8_0``, ``bf16`` -> ``BF16``; any
map of rung to type may be given), quantised by the installed ``gguf`` package (``gguf.quants.quantize``: the
reference quantisers of ggml's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks). The rest is the converter's:

- tensor names from ``gguf``'s own tensor map (``token_embd``, ``blk.N.attn_q``, ``output_norm``, ...);
- LLaMA: the rows of ``attn_q`` / ``attn_k`` permuted as the converter's ``LlamaModel.permute`` does (llama.cpp's
  rotary embedding pairs adjacent dimensions; transformers' loader permutes them back);
- Gemma 3: every ``*norm.weight`` stored as ``1 + w`` (the converter's ``norm_shift``: Gemma's RMSNorm scales by
  ``1 + w``, llama.cpp's by the stored weight); the tied embedding written once (no ``output``);
- one-dimensional tensors (norms) in F32, the token embedding (and an untied ``lm_head``) at ``embedding_type``
  (BF16 by default, as ``convert_hf_to_gguf.py --outtype bf16``);
- architecture metadata as the converter's ``set_gguf_parameters`` (context length, widths, heads, key / value
  lengths, RMS epsilon, RoPE base, sliding window);
- the tokenizer: copied field for field from the GGUF the model came from when it is one of the offline models
  (:mod:`gnmr_hf.offline.gguf_models`: their GGUFs were written by that converter, so its token list, merges or
  scores, pre-tokeniser name and special ids are the converter's own), else built from ``tokenizer.json`` as the
  converter's ``get_vocab_base`` does for a byte-level BPE tokenizer (``gpt2`` model, token types, merges, special
  ids and chat template through ``gguf.SpecialVocab``; the pre-tokeniser is written as ``default``: the converter
  picks a name from a hash table of known tokenizers, which this exporter does not carry).

``--uniform TYPE`` writes every decoder linear at ``TYPE`` by the same path (the baseline a plan is compared with).

What the installed ``gguf`` cannot write is refused: the K-quants (``Q2_K`` .. ``Q6_K``) and i-quants (``IQ*``)
have no quantiser in ``gguf.quants``: they need llama.cpp's own ``llama-quantize``, run on a BF16 export of this
module.

Refused in one line, before anything is written (:class:`gnmr_hf.export_folder.ExportError`): a type the
installed ``gguf`` cannot quantise, an architecture this exporter does not know, a tensor whose row length is not
a multiple of its type's block (named), a plan or an adapter of another model, an output that exists.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from gnmr_hf.export_folder import ExportError, check_model_folder, check_sources
from gnmr_hf.offline.gguf_models import MODELS, default_cache_dir, gguf_path, locate_model, resolve_model
from gnmr_hf.strict_json import read_json

#: the GGUF type of each rung when none is given (``low``: every decoder linear the plan does not name)
DEFAULT_RUNG_TYPES = {"low": "Q4_0", "int8": "Q8_0", "bf16": "BF16"}
#: the types a plan may name: those llama.cpp serves for a dense weight that ``gguf.quants`` may be able to write
#: (which of them the installed ``gguf`` really writes is probed: :func:`writable_types`)
CANDIDATE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16", "F32")
#: transformers architecture -> llama.cpp architecture (``general.architecture``)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Gemma3ForCausalLM": "gemma3"}


@lru_cache(maxsize=1)
def writable_types() -> tuple[str, ...]:
    """The types of :data:`CANDIDATE_TYPES` the installed ``gguf`` quantises (probed on one block each)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    out = []
    for name in CANDIDATE_TYPES:
        qtype = GGMLQuantizationType[name]
        try:
            quantize(np.zeros((1, GGML_QUANT_SIZES[qtype][0]), dtype=np.float32), qtype)
        except (NotImplementedError, KeyError):
            continue
        out.append(name)
    return tuple(out)


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def check_type(name: Any, what: str) -> str:
    """``name`` as a GGUF type name the installed ``gguf`` writes; one ``ExportError`` line otherwise."""
    from gguf import GGMLQuantizationType

    key = str(name).upper()
    if key in writable_types():
        return key
    known = key in GGMLQuantizationType.__members__
    why = "the installed gguf " + _gguf_version() + (" cannot quantise it" if known else " has no such type")
    hint = " (K-quants and i-quants need llama.cpp's llama-quantize)" if known and ("_K" in key or key.startswith("IQ")) else ""
    raise ExportError(f"{what} {name!r}: {why}{hint}; it writes {', '.join(writable_types())}")


def block_size(type_name: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]


# ------------------------------------------------------------------------------------------- inputs


def _resolve(model: str | os.PathLike) -> tuple[Path, str | None]:
    """The BF16 model folder and the offline alias it came from (None for any other folder)."""
    kind, where = locate_model(model)
    if kind == "hub":
        raise ExportError(f"{model}: not a folder here nor an offline alias ({', '.join(MODELS)}); download it first")
    path = Path(resolve_model(model)).resolve()
    for alias in MODELS:
        if kind == "alias" and where == alias or path == default_cache_dir(alias).resolve():
            return path, alias
    return path, None


def _read_plan(plan: str | os.PathLike | Mapping[str, str] | None) -> tuple[dict[str, str], dict[str, Any], Path | None]:
    from gnmr_hf.planning.plan import Plan, PlanError  # torch (the planning package): keeps --help light

    if plan is None:
        return {}, {}, None
    if isinstance(plan, Mapping):
        return dict(plan), {}, None
    try:
        loaded = Plan.load(plan).require_planned()  # a profile without a plan: refused (--uniform TYPE is that file)
    except (PlanError, ValueError) as e:
        raise ExportError(str(e)) from None
    return dict(loaded.rungs), dict(loaded.data), loaded.source


def _low_type(data: Mapping[str, Any], plan_path: Path | None, low_type: str | None) -> str:
    """The low linears' type: a GGUF plan's own (another explicit type refused), else ``low_type`` or Q4_0."""
    from gnmr_hf.planning.plan import GGUF_LOWS  # torch (the planning package): keeps --help light

    planned = GGUF_LOWS.get(str(data.get("low")))
    if planned is None:
        return low_type or DEFAULT_RUNG_TYPES["low"]
    if low_type is not None and str(low_type).upper() != planned:
        raise ExportError(f"--low-type {low_type}: {plan_path} was profiled against {planned} (its gains rank that "
                          f"type's errors): leave --low-type out (or give {planned}), or profile again with "
                          f"--low {str(low_type).lower()}")
    return planned


def _architecture(config: dict[str, Any], model_path: Path) -> str:
    archs = config.get("architectures") or []
    arch = archs[0] if archs else config.get("model_type")
    if arch not in ARCHITECTURES:
        raise ExportError(f"{model_path}: architecture {arch!r} is not one this GGUF export writes "
                          f"({', '.join(f'{k} as {v}' for k, v in ARCHITECTURES.items())})")
    return ARCHITECTURES[arch]


def _check_output(output: str | os.PathLike, force: bool) -> Path:
    out = Path(output).expanduser()
    if out.suffix != ".gguf":
        raise ExportError(f"{out}: the output is one file named *.gguf")
    if out.is_dir():
        raise ExportError(f"{out} is a folder: the output is one .gguf file")
    if out.exists() and not force:
        raise ExportError(f"{out} exists: give another path, or force=True (--force) to replace it")
    if not out.parent.is_dir():
        raise ExportError(f"{out.parent}: no such folder for the output")
    return out.resolve()


# ------------------------------------------------------------------------------------------- the export


def export_gguf(model: str | os.PathLike, plan: str | os.PathLike | Mapping[str, str] | None, output: str | os.PathLike,
                adapter: str | os.PathLike | None = None, low_type: str | None = None,
                rung_types: Mapping[str, str] | None = None, uniform: str | None = None,
                embedding_type: str = "BF16", force: bool = False) -> dict[str, Any]:
    """Write ``model`` (with ``adapter`` merged) as one GGUF file, each decoder linear at its rung's type.

    Args:
        model: a BF16 model folder or an offline alias (:func:`gnmr_hf.offline.gguf_models.locate_model`).
        plan: ``{linear: rung}`` (``"int8"`` / ``"bf16"``, or any key of ``rung_types``), a plan file or its
            folder (:meth:`gnmr_hf.planning.plan.Plan.load`), or None with ``uniform``.
        output: the ``.gguf`` file to write (a temporary file beside it, renamed into place, mode 0644).
        adapter: a PEFT LoRA folder merged into the BF16 weights first (``merge_and_unload``).
        low_type: the type of every decoder linear the plan does not name; None (the default): the plan's own
            for a plan profiled against a GGUF type (``gnmr-hf profile --serve gguf``: its ``low``, another type is
            refused), else ``Q4_0``.
        rung_types: rung -> GGUF type, over :data:`DEFAULT_RUNG_TYPES` (``{"int8": "Q5_1"}``).
        uniform: every decoder linear at this type (the uniform baseline; ``plan`` must be None).
        embedding_type: the token embedding's (and an untied ``lm_head``'s) type.
        force: replace an existing ``output``.

    Returns:
        A summary: the file, its architecture, the tensor count per type, the planned linears per type, the bytes
        on disk and where the tokenizer came from.

    Raises:
        ExportError: bad input, in one line, before anything is written.
    """
    if uniform is not None:
        if plan is not None:
            raise ExportError("give a plan or uniform=TYPE, not both")
        uniform = check_type(uniform, "uniform type")
        types = {"low": uniform}
    embedding_type = check_type(embedding_type, "embedding type")
    rungs, data, plan_path = _read_plan(plan)
    if uniform is None:
        types = {**DEFAULT_RUNG_TYPES, "low": _low_type(data, plan_path, low_type), **dict(rung_types or {})}
        types = {rung: check_type(t, f"the {rung} rung's type") for rung, t in types.items()}
    model_path, alias = _resolve(model)
    config = check_model_folder(model_path)
    arch = _architecture(config, model_path)
    if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
        raise ExportError(f"{adapter} is not a PEFT adapter folder (no adapter_config.json)")
    out = _check_output(output, force)

    meta = _meta(model_path)
    from gnmr_hf.planning.groups import decoder_linears  # torch (the planning package): keeps --help light

    linears = decoder_linears(meta)
    shapes = {n: tuple(m.weight.shape) for n, m in meta.named_modules() if n in set(linears)}
    unknown = [n for n in rungs if n not in shapes]
    if unknown:
        raise ExportError(f"the plan names {unknown[0]!r}, not a decoder linear of {model_path} "
                          f"({len(unknown)} such names)")
    bad_rung = {n: r for n, r in rungs.items() if r not in types or r == "low"}
    if bad_rung:
        name, rung = next(iter(bad_rung.items()))
        raise ExportError(f"the plan puts {name!r} on {rung!r}: a rung is one of "
                          f"{', '.join(r for r in types if r != 'low')}")
    planned = {n: types[rungs.get(n, "low")] for n in linears}
    for name, qtype in [*planned.items(), *((n, embedding_type) for n in _embeddings(meta))]:
        row = _shape_of(meta, name)[-1]
        if row % block_size(qtype):
            raise ExportError(f"{name}: its rows hold {row} values, not a multiple of {qtype}'s block of "
                              f"{block_size(qtype)}: give it another type (BF16 has blocks of 1)")
    check_sources(model_path, plan_path, data, adapter, meta=meta)
    del meta

    merged = _merged_bf16(model_path, adapter)
    counts: dict[str, int] = {}
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        tokenizer_from = _write(merged, arch, config, model_path, alias, planned, embedding_type,
                                types.get("low", uniform), tmp, counts)
        os.chmod(tmp, 0o644)  # readable by a server running as another user
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    by_type: dict[str, int] = {}
    for t in planned.values():
        by_type[t] = by_type.get(t, 0) + 1
    return {"file": str(out), "architecture": arch, "model": str(model_path), "alias": alias,
            "adapter": str(adapter) if adapter is not None else None, "uniform": uniform,
            "rung_types": types, "linears_by_type": by_type, "tensors_by_type": counts,
            "bytes": out.stat().st_size, "tokenizer": tokenizer_from}


def _meta(model_path: Path):
    """The architecture on the meta device (shapes only, nothing read but config.json)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _embeddings(meta) -> list[str]:
    """The 2-D tensors besides the decoder linears: the token embedding and an untied lm_head."""
    out = ["model.embed_tokens"]
    if not getattr(meta.config, "tie_word_embeddings", False):
        out.append("lm_head")
    return out


def _shape_of(meta, name: str) -> tuple[int, ...]:
    return tuple(meta.get_submodule(name).weight.shape)


def _merged_bf16(model_path: Path, adapter):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return model.eval()


def _permute(w, n_head: int, n_head_kv: int | None):
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: rows (out, in) regrouped per head from HF's half-split
    rotary layout to llama.cpp's interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _cfg(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    rope = getattr(config, "rope_parameters", None) or {}
    for n in names:
        if isinstance(rope, dict) and rope.get(n) is not None:
            return rope[n]
        if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict) and rope["full_attention"].get(n) is not None:
            return rope["full_attention"][n]
    return default


def _add_architecture(w, arch: str, c, file_type: str) -> None:
    from gguf import LlamaFileType

    heads, kv = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(_cfg(c, "rope_theta", default=10000.0 if arch == "llama" else 1_000_000.0)))
    if arch == "llama":
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(head_dim)
        if head_dim != c.hidden_size // heads:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
    else:  # gemma3: Gemma3Model.set_gguf_parameters
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(c.sliding_window)
    w.add_file_type(LlamaFileType.ALL_F32 if file_type == "F32" else LlamaFileType[f"MOSTLY_{file_type}"])
    w.add_quantization_version(2)


def _write(model, arch: str, config_json: dict[str, Any], model_path: Path, alias: str | None,
           planned: dict[str, str], embedding_type: str, file_type: str, path: Path, counts: dict[str, int]) -> str:
    import gguf
    import numpy as np
    import torch

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name(config_json.get("_name_or_path") and Path(str(config_json["_name_or_path"])).name or model_path.name)
    _add_architecture(w, arch, c, file_type)
    tokenizer_from = _add_tokenizer(w, model_path, alias, c.vocab_size)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.GEMMA3,
                                     c.num_hidden_layers)
    tied = bool(getattr(c, "tie_word_embeddings", False))
    heads, kv = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # the converter writes a tied embedding once (llama.cpp reads token_embd for the output)
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        module = hf_name.rsplit(".", 1)[0]
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise RuntimeError(f"{hf_name}: no GGUF name in gguf's tensor map for {arch}")
        data = tensor.detach().to(torch.float32)
        if arch == "llama" and module.endswith("self_attn.q_proj"):
            data = _permute(data, heads, heads)
        elif arch == "llama" and module.endswith("self_attn.k_proj"):
            data = _permute(data, heads, kv)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + 1.0  # Gemma3Model.norm_shift
        if module in planned and data.dim() > 1:
            qtype = planned[module]
        elif data.dim() == 1:  # norms and biases, as the converter writes them
            qtype = "F32"
        else:
            qtype = embedding_type
        array = data.numpy()
        quant = gguf.GGMLQuantizationType[qtype]
        if qtype == "F32":
            w.add_tensor(name, array.astype(np.float32))
        elif qtype == "F16":
            w.add_tensor(name, array.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(array, quant), raw_dtype=quant)
        counts[qtype] = counts.get(qtype, 0) + 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokenizer_from


# ------------------------------------------------------------------------------------------- tokenizer


def _add_tokenizer(w, model_path: Path, alias: str | None, vocab_size: int) -> str:
    if alias is not None:
        return _copy_tokenizer(w, model_path, alias)
    return _bpe_tokenizer(w, model_path, vocab_size)


def _copy_tokenizer(w, model_path: Path, alias: str) -> str:
    """The ``tokenizer.*`` fields of the GGUF the offline model was converted from, as written there."""
    import gguf

    with tempfile.TemporaryDirectory() as work:
        source = gguf_path(alias, work)
        reader = gguf.GGUFReader(source)
        has_template = False
        for key, field in reader.fields.items():
            if not key.startswith("tokenizer."):
                continue
            has_template |= key == gguf.Keys.Tokenizer.CHAT_TEMPLATE
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), vtype, sub_type=sub)
        del reader
    if not has_template:  # the source file carries none: the converter takes the folder's
        template = gguf.SpecialVocab(model_path, load_merges=False).chat_template
        if template:
            w.add_chat_template(template)
    return f"copied from {MODELS[alias].gguf_file}"


def _bpe_tokenizer(w, model_path: Path, vocab_size: int) -> str:
    """The converter's ``get_vocab_base`` + ``SpecialVocab`` for a byte-level BPE ``tokenizer.json``."""
    import gguf

    path = model_path / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{model_path} has no tokenizer.json: llama.cpp needs the tokenizer in the file")
    data = read_json(path)
    tok_model = data.get("model") or {}
    byte_level = "ByteLevel" in str(data.get("pre_tokenizer")) or "ByteLevel" in str(data.get("decoder"))
    if tok_model.get("type") != "BPE" or not byte_level:
        raise ExportError(f"{path}: a {tok_model.get('type')} tokenizer{'' if byte_level else ' without byte-level BPE'}; "
                          "this export writes byte-level BPE tokenizers (or copies an offline model's own)")
    vocab = dict(tok_model["vocab"])
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    for i, t in added.items():
        vocab[t["content"]] = i
    reverse = {i: tok for tok, i in vocab.items()}
    if max(reverse) >= vocab_size:
        raise ExportError(f"{path}: token id {max(reverse)} is past the model's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(model_path, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    return f"built from {path.name} (byte-level BPE)"


# ------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gnmr_hf.export_gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="BF16 model folder or offline alias")
    parser.add_argument("--plan", help="profile.json (or its folder) holding the plan; leave out with --uniform")
    parser.add_argument("--adapter", help="PEFT LoRA folder merged into the BF16 weights first")
    parser.add_argument("--output", required=True, help="the .gguf file to write")
    parser.add_argument("--low-type", default=None, help="type of every decoder linear the plan leaves low (default: "
                        "a GGUF plan's own, else Q4_0)")
    parser.add_argument("--int8-type", default="Q8_0", help="type of the plan's int8 rung")
    parser.add_argument("--bf16-type", default="BF16", help="type of the plan's bf16 rung")
    parser.add_argument("--uniform", metavar="TYPE", help="every decoder linear at TYPE (no plan)")
    parser.add_argument("--embedding-type", default="BF16", help="type of the token embedding (and untied lm_head)")
    parser.add_argument("--force", action="store_true", help="replace an existing output file")
    args = parser.parse_args(argv)
    if args.plan is None and args.uniform is None:
        print("export_gguf: give --plan PROFILE_JSON or --uniform TYPE", file=sys.stderr)
        return 2
    try:
        s = export_gguf(args.model, args.plan, args.output, adapter=args.adapter, low_type=args.low_type,
                        rung_types={"int8": args.int8_type, "bf16": args.bf16_type}, uniform=args.uniform,
                        embedding_type=args.embedding_type, force=args.force)
    except ExportError as e:
        print(f"export_gguf: {e}", file=sys.stderr)
        return 2
    linears = ", ".join(f"{t} x{n}" for t, n in sorted(s["linears_by_type"].items()))
    tensors = ", ".join(f"{t} x{n}" for t, n in sorted(s["tensors_by_type"].items()))
    print(f"wrote {s['file']} ({s['architecture']}, {s['bytes']:,} bytes)")
    print(f"  decoder linears: {linears}")
    print(f"  all tensors: {tensors}")
    print(f"  tokenizer: {s['tokenizer']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
