"""The ``gnmr-hf`` command: ``gnmr-hf demo | eval | report | profile | export ...``.

Each sub-command lives in its own module and is imported only when used, so ``gnmr-hf --help``
stays fast and needs none of the optional dependencies.
"""

from __future__ import annotations

import importlib
import sys

_COMMANDS = {
    "demo": ("gnmr_hf.demo", "train bf16 + int8 + gnmr (or --low nf4: bf16 + nf4 + planned-nf4) SmolLM2 recipes, "
                             "evaluate, compare, plot"),
    "eval": ("gnmr_hf.evaluation.evaluate", "score a base model (+ LoRA adapter) with lm-evaluation-harness"),
    "report": ("gnmr_hf.reporting.report", "print the paper's Table 7 layout for several eval result files"),
    "profile": ("gnmr_hf.planning.cli", "before training: which quantised linears to keep on BF16 for a byte budget "
                                   "(price table, llm_int8_skip_modules list, plot)"),
    "export": ("gnmr_hf.export", "write the planned mixed model as a folder stock from_pretrained loads with no "
                                 "arguments (or --merge: the adapter folded into BF16)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: gnmr-hf {" + ",".join(_COMMANDS) + "} [options]\n")
        for name, (_, help_text) in _COMMANDS.items():
            print(f"  {name:<8}{help_text}")
        print("\nOptions and examples of a command: gnmr-hf COMMAND --help")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        print(f"gnmr-hf: unknown command {name!r}; choose one of {', '.join(_COMMANDS)} (gnmr-hf --help)",
              file=sys.stderr)
        return 2
    # a misspelt model, a missing --data, a budget that does not parse: refused before torch and transformers
    from gnmr_hf.preflight import check_command

    why = check_command(name, rest)
    if why:
        print(f"gnmr-hf {name}: error: {why}", file=sys.stderr)
        return 2
    from gnmr_hf._import_utils import quiet_import_noise

    quiet_import_noise()
    module = importlib.import_module(_COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
