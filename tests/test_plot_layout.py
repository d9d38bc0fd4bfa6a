"""Every plot the project writes, at its saved size: titles, legends and labels lie inside the figure.

Each plot is drawn from real inputs (the demo's titles, a profile.json fixture, the committed bench
results) and checked as saved with :func:`gnmr_hf.reporting.plots.texts_outside`, which is first shown
to catch the cut-off title that plain ``tight_layout`` leaves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gnmr_hf.reporting import plots  # noqa: E402
from tests.conftest import load_bench  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEMO_TITLE = "SmolLM2-135M-Instruct LoRA on generated GSM8K-style problems (BF16 vs INT8)"  # gnmr_hf/demo/report.py (draw_plots)


def _fits(figs):
    assert figs, "the plot function drew no figure"
    for fig in figs:
        assert plots.texts_outside(fig) == []


def test_the_check_sees_a_cut_off_title_and_fit_text_wraps_it_without_losing_words():
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot([0, 1], [0, 1], label="bf16")
    ax.legend()
    ax.set_title(DEMO_TITLE)
    fig.tight_layout()
    assert plots.texts_outside(fig) == [DEMO_TITLE]  # what the demo's PNG showed: "... (BF16 vs INT"
    plots.fit_text(fig)
    assert plots.texts_outside(fig) == []
    assert ax.get_title().split() == DEMO_TITLE.split() and "\n" in ax.get_title()
    plt.close(fig)


def _runs(tmp_path: Path) -> dict[str, Path]:
    runs = {}
    for name, losses in {"bf16": [2.0, 1.5, 1.2] * 10, "int8": [2.1, 1.7, 1.3] * 10, "gnmr": [2.0, 1.6, 1.2] * 10}.items():
        d = tmp_path / name
        d.mkdir()
        (d / "trainer_state.json").write_text(json.dumps({"log_history": [
            {"step": i + 1, "loss": x} for i, x in enumerate(losses)]}))
        runs[name] = d
    return runs


def test_demo_plots_fit(tmp_path, kept_figures):
    plots.plot_loss_curves(_runs(tmp_path), tmp_path / "loss.png", title=DEMO_TITLE)
    trace = tmp_path / "gnmr_trace.jsonl"
    trace.write_text("".join(json.dumps({"step": s, "gnmr": [1.0 + 0.1 * ((s + u) % 5) for u in range(30)],
                                         "active": [s % 30]}) + "\n" for s in range(1, 31)))
    plots.plot_gnmr_heatmap(trace, tmp_path / "h.png",
                            title="GNMR per decoder layer (SmolLM2-135M, INT8 + BF16 recovery)")
    _fits(kept_figures())


def test_report_plot_fits(tmp_path, kept_figures):
    from gnmr_hf.reporting.report import plot_table

    rows = [{"method": m, "gsm8k_em": 0.1 * i, "mmlu_acc": 0.25, "hellaswag_acc": 0.3, "wikitext_word_ppl": 30.0 + i}
            for i, m in enumerate(["BF16 LoRA", "Fixed INT8 LoRA", "GNMR INT8/BF16 (paper)", "planned-nf4"])]
    plot_table(rows, tmp_path / "t.png")
    _fits(kept_figures())


def test_profile_plot_fits(tmp_path, kept_figures):
    from gnmr_hf import planning
    from gnmr_hf.reporting.profile_plot import plot_profile

    prof = planning.SensitivityProfile.from_json(ROOT / "tests" / "data" / "profile_format1.json")
    price = [planning.plan(prof, budget_fraction=f) for f in (0.05, 0.10, 0.25)]
    plot_profile(prof, price, tmp_path / "profile.png", title="gemma3-270m-bf16, nf4: profiled on 4096 target tokens "
                 "of the Python 3.11 tutorial")
    _fits(kept_figures())


@pytest.mark.parametrize("bench", ["qlora_budget", "nf4_bench", "profile_criteria"])
def test_bench_plots_fit_on_the_committed_results(bench, tmp_path, kept_figures):
    mod = load_bench(bench)
    if bench == "qlora_budget":
        mod.plot(mod.collect(RESULTS / "qlora_budget"), str(tmp_path / "q.png"))
        mod.plot_ladder(mod.collect(RESULTS / "qlora_budget"), str(tmp_path / "l.png"), RESULTS / "qlora_budget")
    elif bench == "nf4_bench":
        runs = mod._collect(RESULTS / "nf4")
        oracle = [r for m in runs.values() for r in m.values() if r.get("oracle")]
        mod.plot(runs, oracle, str(tmp_path / "n.png"))
    else:
        mod.plot(RESULTS / "profile_criteria", tmp_path / "p.png")
    _fits(kept_figures())


def test_stress_report_plot_fits(tmp_path, kept_figures):
    import importlib.util

    spec = importlib.util.spec_from_file_location("stress_report", ROOT / "recipes" / "stress" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    report._loss_figure(lambda ax: ax.plot([1, 2, 3], [3, 2, 1], label="gnmr int8 (3 seeds)"), tmp_path / "s.png",
                        "validation loss per token", "Stress bench: median and min-max over seeds, "
                        "LLaMA-shaped decoder on the Python 3.11 documentation")
    _fits(kept_figures())
