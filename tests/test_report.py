"""The report: `cancelfl compare` (README command 1's engine-independent part) and a single run's own report."""

from __future__ import annotations

import argparse
import json

import pytest

from server.compare import compare
from server.launch import main, run_inprocess

PNG = b"\x89PNG\r\n\x1a\n"


def _png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG and path.stat().st_size > 2000


def test_compare_writes_the_side_by_side_report(tmp_path):
    out = tmp_path / "cmp"
    report, failed = compare(["fedavg", "ldp", "nadp"], epsilon=1.0, out=out, engine="inprocess",
                             overrides={"num-rounds": 2, "dataset": "digits"}, command="cancelfl compare ...",
                             inprocess=run_inprocess)
    assert report == out.resolve() / "report.md" and failed == []
    for name in ("accuracy.png", "epsilon.png", "noise.png"):
        assert _png(out / name), name
    text = report.read_text()
    for method in ("fedavg", "ldp", "nadp"):
        assert f"| {method} |" in text
        run = out / method
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2
        # every run also wrote its own report
        assert (run / "report.md").is_file() and _png(run / "accuracy.png")
    assert "![accuracy per round](accuracy.png)" in text and "cancelfl compare ..." in text
    # The noise figures the report plots: nadp's upload noise cancels (far more noise in an upload than in the
    # model), ldp's independent noise only averages down by sqrt(clients), fedavg has none.
    noise = {m: [json.loads(line) for line in (out / m / "metrics.jsonl").read_text().splitlines()][-1]
             for m in ("fedavg", "ldp", "nadp")}
    assert noise["fedavg"]["upload_noise_std"] == 0 == noise["fedavg"]["model_noise_std"]
    ldp_ratio = noise["ldp"]["upload_noise_std"] / noise["ldp"]["model_noise_std"]
    nadp_ratio = noise["nadp"]["upload_noise_std"] / noise["nadp"]["model_noise_std"]
    # record-level ldp: each client's std follows its n_k (143-144 records here), so sqrt(10) up to 1 %
    assert ldp_ratio == pytest.approx(10 ** 0.5, rel=1e-2) and nadp_ratio > 2 * ldp_ratio
    assert "| fedavg | " in text and "| none | none |" in text  # fedavg: no guarantee in either direction


def test_compare_exits_1_naming_a_method_that_did_not_finish(tmp_path, capsys):
    def flaky(cfg, verbose=False):
        if cfg["method"] == "ldp":
            raise RuntimeError("diverged")
        return run_inprocess(cfg, verbose=verbose)

    from server.compare import main as compare_main

    args = argparse.Namespace(methods="fedavg,ldp", epsilon=1.0, out=str(tmp_path / "cmp"), engine="inprocess",
                              verbose=False)
    assert compare_main(args, {"num-rounds": 1, "dataset": "digits"}, flaky) == 1
    err = capsys.readouterr().err
    assert "without ldp, which did not finish" in err and "diverged" in err
    text = (tmp_path / "cmp" / "report.md").read_text()
    assert "| fedavg |" in text and "`ldp` did not finish" in text


def test_compare_refuses_a_setting_one_method_refuses_before_any_method_runs(tmp_path, capsys):
    """A clip float64 cannot resolve is refused for ldp at start: fedavg (listed first, no clip) does not run either."""
    out = tmp_path / "cmp"
    assert main(["compare", "--methods", "fedavg,ldp", "--run-config", "clip=1e-200 num-rounds=1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "ldp: run-config 'clip' = 1e-200" in err
    assert not (out / "fedavg" / "metrics.jsonl").exists() and not (out / "report.md").exists()


def test_compare_command_refuses_a_bad_method_or_key(tmp_path, capsys):
    assert main(["compare", "--methods", "fedavg,nope", "--out", str(tmp_path / "a")]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["compare", "--methods", ",", "--out", str(tmp_path / "e")]) == 2
    assert "--methods ',' names no method; known: fedavg" in capsys.readouterr().err
    assert main(["compare", "--methods", "fedavg", "--run-config", "num-roundz=2", "--out", str(tmp_path / "b")]) == 2
    assert not (tmp_path / "b" / "report.md").exists()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "report.md").write_text("an earlier comparison")
    assert main(["compare", "--methods", "fedavg", "--out", str(tmp_path / "c")]) == 2
    assert "earlier comparison" in capsys.readouterr().err


# ------------------------------------------------------------------ verdicts and plots from synthetic run folders
def _write_run(folder, *, acc, views=(), rounds=3, up_noise=None, model_noise=None, target=1.0):
    """A run folder as the round loop writes it: metrics.jsonl and summary.json (views: what epsilon protects)."""
    folder.mkdir(parents=True)
    privacy = {"target_epsilon": target if views else None, "unit": "record" if views else "none",
               "uplink": {"adversary": "server" if "uploads" in views else None,
                          "epsilon": 0.99 if "uploads" in views else None},
               "downlink": {"adversary": "anyone" if "published model" in views else None,
                            "epsilon": 0.98 if "published model" in views else None}}
    rows = [{"round": r, "test_accuracy": acc * r / rounds, "round_time_s": 0.1,
             "epsilon_uplink": 0.99 * r / rounds if "uploads" in views else None,
             "epsilon_downlink": 0.98 * r / rounds if "published model" in views else None,
             "upload_noise_std": up_noise, "model_noise_std": model_noise} for r in range(1, rounds + 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "summary.json").write_text(json.dumps({
        "config": {"dataset": "digits", "num-clients": 10, "num-rounds": rounds, "epsilon": target, "delta": 1e-5},
        "final_accuracy": acc, "privacy": privacy}))
    return folder


BOTH = ("uploads", "published model")


def test_verdict_names_the_price_of_the_extra_protection(tmp_path):
    from strategies.run.report import RunData, verdict, write_report

    runs = {"fedavg": _write_run(tmp_path / "fedavg", acc=0.91, rounds=10, up_noise=0.0, model_noise=0.0),
            "cdp": _write_run(tmp_path / "cdp", acc=0.858, views=("published model",), rounds=20, up_noise=0.0,
                              model_noise=0.03),
            "nadp": _write_run(tmp_path / "nadp", acc=0.864, views=BOTH, rounds=20, up_noise=0.8, model_noise=0.03),
            "ldp": _write_run(tmp_path / "ldp", acc=0.52, views=BOTH, rounds=30, up_noise=0.3, model_noise=0.1)}
    text = write_report(runs, tmp_path / "report").read_text()
    # One verdict line: the run that protects the most, then is most accurate (nadp), against the others.
    body = text.split("## Verdict\n\n", 1)[1].split("\n\n", 1)[0]
    assert "\n" not in body and body.startswith("**nadp** protects the uploads and the published model"), body
    assert "the accuracy of cdp (which protects the published model), 0.864 vs 0.858, with the uploads protected too" \
        in body
    assert "epsilon 1 per record" in body and "uploads 0.99" in body
    assert "against ldp, which protects the same: above it (0.864 vs 0.520)" in body
    assert text.count("**ldp**") == text.count("**cdp**") == 0
    # worse is said as worse, with the comparator that protects less (the verdict of any run)
    data = [RunData.load(name, folder) for name, folder in runs.items()]
    lines = {r.name: verdict(r, data) for r in data}
    assert "0.338 below cdp (which protects the published model), 0.520 vs 0.858" in lines["ldp"]
    assert "0.052 below fedavg (no DP), 0.858 vs 0.910, the price of protecting the published model." in lines["cdp"]
    assert lines["fedavg"] is None  # no guarantee: no verdict
    # the header states each run's own rounds; the table says them per run
    assert "num-rounds: fedavg 10, cdp 20, nadp 20, ldp 30" in text
    assert "No guarantee, so no line: uploads: fedavg, cdp; published model: fedavg." in text


def test_the_verdict_picks_the_most_protective_run_even_when_less_accurate(tmp_path):
    from strategies.run.report import write_report

    runs = {"fedavg": _write_run(tmp_path / "fedavg", acc=0.91, up_noise=0.0, model_noise=0.0),
            "cdp": _write_run(tmp_path / "cdp", acc=0.85, views=("published model",), up_noise=0.0, model_noise=0.03),
            "ldp": _write_run(tmp_path / "ldp", acc=0.60, views=BOTH, up_noise=0.3, model_noise=0.1)}
    text = write_report(runs, tmp_path / "report").read_text()
    body = text.split("## Verdict\n\n", 1)[1].split("\n\n", 1)[0]
    assert body.startswith("**ldp**") and "0.250 below cdp" in body and "\n" not in body, body


def test_single_run_has_no_verdict(tmp_path):
    from strategies.run.report import write_report

    text = write_report({"nadp": _write_run(tmp_path / "nadp", acc=0.8, views=BOTH)}, tmp_path / "r").read_text()
    assert "## Verdict" not in text


def test_plots_draw_every_series_and_no_bar_for_zero_or_missing_noise(tmp_path):
    from matplotlib.colors import to_hex

    from strategies.run.report import RunData, accuracy_figure, epsilon_figure, noise_figure, pyplot

    folders = {"fedavg": _write_run(tmp_path / "fedavg", acc=0.9, up_noise=0.0, model_noise=0.0),
               "old": _write_run(tmp_path / "old", acc=0.7, views=BOTH),  # no noise figures at all (n/a)
               "cdp": _write_run(tmp_path / "cdp", acc=0.85, views=("published model",), up_noise=0.0,
                                 model_noise=0.03),
               "nadp": _write_run(tmp_path / "nadp", acc=0.86, views=BOTH, up_noise=0.8, model_noise=0.03)}
    runs = [RunData.load(name, folder) for name, folder in folders.items()]
    fig = noise_figure(runs)
    (ax,) = fig.axes
    heights = sorted(round(bar.get_height(), 6) for bar in ax.patches)
    assert heights == [0.03, 0.03, 0.8]  # positive figures only: no bar for fedavg's 0 or old's n/a
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("0") == 3 and texts.count("n/a") == 2
    fig = epsilon_figure(runs)
    upload, model = fig.axes
    assert [line.get_label() for line in upload.lines if not line.get_label().startswith("_")] == ["old", "nadp"]
    assert [line.get_label() for line in model.lines if not line.get_label().startswith("_")] == ["old", "cdp", "nadp"]
    assert "no guarantee: fedavg, cdp" in upload.get_xlabel() and "no guarantee: fedavg" in model.get_xlabel()
    fig = accuracy_figure(runs)
    styles = {(to_hex(line.get_color()), line.get_linestyle(), line.get_marker()) for line in fig.axes[0].lines}
    assert len(styles) == len(runs)  # every run its own colour, line style and marker
    assert len({line.get_linestyle() for line in fig.axes[0].lines}) > 1
    pyplot().close("all")
