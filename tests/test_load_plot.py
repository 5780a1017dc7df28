"""bench/load.py against the real server, briefly: its table, its JSON, and
the PNG it draws (opened as an image: format and size, not the look); then
the same figure from saved result files, one line per server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

PIL = pytest.importorskip("PIL.Image", reason="pillow is a test extra (pyproject.toml)")
pytest.importorskip("matplotlib", reason="matplotlib is a test extra (pyproject.toml)")

LOAD = ROOT / "bench" / "load.py"
SIZE = (1350, 420)  # load.PLOT_SIZE * load.PLOT_DPI


def _load(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(LOAD), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _image(path):
    with PIL.open(path) as img:
        img.load()
        assert img.format == "PNG" and img.size == SIZE, (img.format, img.size)
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 20  # lines, text and grid, not a blank image


def test_load_writes_table_json_and_plot(server, tmp_path):
    png, out = tmp_path / "load.png", tmp_path / "load.json"
    proc = _load("--url", f"mlxfast={server.url}", "--api-key", server.api_key, "--levels", "1,2",
                 "--requests", "2", "--max-tokens", "4", "--json", str(out), "--plot", str(png))
    runs = json.loads(out.read_text())
    assert [r["label"] for r in runs] == ["mlxfast"] and runs[0]["url"] == server.url
    levels = runs[0]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    for lv in levels:
        assert lv["requests"] == 2 and lv["errors"] == 0, lv
        assert lv["output_tokens"] == 2 * 4  # ignore_eos: every request runs to max tokens
        assert 0 < lv["ttft_p50_ms"] <= lv["ttft_p95_ms"] and 0 < lv["itl_p50_ms"] <= lv["itl_p95_ms"]
        assert lv["output_tok_s"] > 0
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [r[:3] for r in rows] == [["1", "2", "0"], ["2", "2", "0"]]
    assert f"plot: {png}" in proc.stdout
    _image(png)

    # Saved runs of several servers on one figure: the new format, and an older bare list of levels.
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{**runs[0], "label": "second"}]))
    bare = tmp_path / "third.json"
    bare.write_text(json.dumps(levels))
    cmp_png = tmp_path / "compare.png"
    proc = _load("--results", str(out), str(other), str(bare), "--plot", str(cmp_png), "--title", "three servers")
    assert [line for line in proc.stdout.splitlines() if line.startswith("== ")] == [
        "== mlxfast (from a results file)", "== second (from a results file)", "== third (from a results file)"]
    _image(cmp_png)


def test_plot_draws_one_line_per_server_and_percentile(tmp_path):
    """The figure's contents, read back from matplotlib: a line per server in
    the throughput panel and a p50 and a p95 line per server in the others."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import load
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def lv(c, tps):
        return {"concurrency": c, "output_tok_s": tps, "ttft_p50_ms": 10.0 * c, "ttft_p95_ms": 12.0 * c,
                "itl_p50_ms": 5.0, "itl_p95_ms": 7.0}

    runs = [{"label": "a", "levels": [lv(1, 50), lv(4, 120)]}, {"label": "b", "levels": [lv(1, 40), lv(4, 60)]}]
    seen = {}
    save = plt.Figure.savefig

    def spy(fig, path, **kw):
        seen["axes"] = [[(line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
                         for line in ax.get_lines()] for ax in fig.axes]
        return save(fig, path, **kw)

    plt.Figure.savefig = spy
    try:
        load.plot(runs, str(tmp_path / "x.png"))
    finally:
        plt.Figure.savefig = save
    thr, ttft, itl = seen["axes"]
    assert thr == [("a", [1, 4], [50, 120]), ("b", [1, 4], [40, 60])]
    assert [x[0] for x in ttft] == ["a p50", "a p95", "b p50", "b p95"]
    assert ttft[1][2] == [12.0, 48.0] and [x[0] for x in itl] == ["a p50", "a p95", "b p50", "b p95"]
    _image(tmp_path / "x.png")
