"""The byte-level GPT, the stdlib text corpus, ``kaisa-train --task lm`` and bench/convergence/gpt.py."""

import gzip
import hashlib
import json
import math
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from kaisa.train import text
from kaisa.train.cli import main
from kaisa.train.models import build_model
from kaisa.train.models.gpt import gpt
from tests.support.bench import load_bench
from tests.support.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[2]


def _lm_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--run-dir", str(tmp_path), "--quiet", "--task", "lm", "--no-plot",
        "--steps-per-epoch", "2", "--context", "16", "--d-model", "16", "--batch-size", "4",
        "--text-bytes", "60000", "--eval-windows", "8", "--epochs", "1", *extra,
    ]


def _records(path: Path) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in lines if r.get("type") != "settings"]


# --- corpus -------------------------------------------------------------------------------


def test_corpus_is_a_sorted_fixed_file_list_without_tests(tmp_path: Path) -> None:
    files = {
        "b.py": b"bbb\n", "a.py": b"aa\n", "pkg/c.py": b"cccc\n", "pkg/notes.txt": b"x",
        "test/t.py": b"T", "pkg/tests/u.py": b"U", "site-packages/s.py": b"S",
    }
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    names = [p.relative_to(tmp_path).as_posix() for p in text.stdlib_files(tmp_path)]
    assert names == ["a.py", "b.py", "pkg/c.py"]
    assert bytes(text.load_corpus(root=tmp_path).tolist()) == b"aa\nbbb\ncccc\n"
    assert bytes(text.load_corpus(max_bytes=5, root=tmp_path).tolist()) == b"aa\nbb"


def test_stdlib_corpus_is_deterministic_and_split_by_position() -> None:
    files = text.stdlib_files()
    assert files and all(f.suffix == ".py" for f in files)
    assert not any({"test", "tests", "site-packages"} & set(f.parts) for f in files)
    first = text.load_corpus(max_bytes=100_000)
    assert len(first) == 100_000 and torch.equal(first, text.load_corpus(max_bytes=100_000))
    train, valid = text.split(first)
    assert len(valid) == 10_000 and torch.equal(torch.cat([train, valid]), first)


def test_the_corpus_is_the_shipped_bytes_whatever_python_runs() -> None:
    """The same 2 MiB on every machine: the shipped file, checked by its SHA-256; its first
    bytes are CPython's ``__future__.py`` (the first file in sorted order)."""
    whole = text.load_corpus()
    assert len(whole) == text.DEFAULT_BYTES == 2_097_152
    data = bytes(whole.tolist())
    assert hashlib.sha256(data).hexdigest() == text.CORPUS_SHA256
    assert data.startswith(b'"""Record of phased-in incompatible language changes.')
    assert (text.CORPUS.parent / "LICENSE").read_text().count("PYTHON SOFTWARE FOUNDATION") >= 1
    if sys.version_info[:3] == (3, 11, 7):  # the interpreter it was cut from: the same cut
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        assert text.files_bytes(stdlib, text.DEFAULT_BYTES) == data


def test_a_damaged_corpus_or_too_many_bytes_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="holds 2097152 bytes; 2097153 asked for"):
        text.load_corpus(max_bytes=text.DEFAULT_BYTES + 1)
    damaged = tmp_path / "stdlib-text.gz"
    damaged.write_bytes(gzip.compress(b"print('other bytes')\n"))
    monkeypatch.setattr(text, "CORPUS", damaged)
    text.shipped_corpus.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"is not the shipped corpus .*reinstall kaisa"):
            text.load_corpus(max_bytes=10)
        damaged.write_bytes(b"not gzip")
        with pytest.raises(ValueError, match="cannot read the shipped corpus"):
            text.load_corpus(max_bytes=10)
    finally:
        text.shipped_corpus.cache_clear()
    with pytest.raises(SystemExit) as exit_info:
        main(["--task", "lm", "--text-bytes", str(2**22), "--run-dir", str(tmp_path),
              "--quiet", "--no-plot"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dataset stdlib-text: the corpus holds 2097152 bytes" in err[0]


def test_training_windows_are_seeded_and_validation_windows_fixed() -> None:
    data = text.load_text(context=8, examples_per_epoch=16, max_bytes=50_000, eval_windows=4)
    again = text.load_text(context=8, examples_per_epoch=16, max_bytes=50_000, eval_windows=4)
    assert torch.equal(data.starts(3), again.starts(3))
    assert not torch.equal(data.starts(3), data.starts(4))
    other = text.load_text(context=8, examples_per_epoch=16, max_bytes=50_000, seed=1)
    assert not torch.equal(data.starts(3), other.starts(3))
    x, y = data.batch(torch.tensor([5, 2]), 3)
    assert x.shape == y.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])
    start = int(data.starts(3)[5])
    assert x[0].tolist() == data.train_stream[start : start + 8].tolist()
    assert torch.equal(data.test_x, again.test_x) and data.test_x.shape == (4, 8)
    assert torch.equal(data.test_x[:, 1:], data.test_y[:, :-1])
    assert int(data.test_x.max()) < 256 and data.train_size == 16


# --- model --------------------------------------------------------------------------------


def test_gpt_ties_head_to_embedding_and_is_causal() -> None:
    torch.manual_seed(0)
    model = gpt(d_model=32, n_layers=2, context=12)
    assert model.head.weight is model.embedding.weight
    assert isinstance(build_model("gpt"), type(model))
    tokens = torch.randint(256, (2, 12))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    for mode in (model.train, model.eval):
        mode()
        with torch.no_grad():
            out, out_changed = model(tokens), model(changed)
        assert out.shape == (2, 12, 256)
        assert torch.equal(out[:, :7], out_changed[:, :7])
        assert not torch.allclose(out[:, 7:], out_changed[:, 7:])
    with pytest.raises(ValueError, match="exceeds the context"):
        model(torch.zeros(1, 13, dtype=torch.long))


# --- kaisa-train --task lm -----------------------------------------------------------------


def test_lm_task_compares_adamw_and_kfac_and_writes_metrics(tmp_path: Path) -> None:
    assert main(_lm_args(tmp_path, "--name", "lm", "--compare", "adamw,kfac")) == 0
    run = tmp_path / "lm"
    records = _records(run / "metrics.jsonl")
    assert [(r["config"], r["epoch"]) for r in records] == [
        ("adamw", 0), ("adamw", 1), ("kfac", 0), ("kfac", 1)
    ]
    # same initial weights; not bit-equal: while kaisa's hooks are attached the evaluation
    # cannot take nn.TransformerEncoderLayer's fused inference path (torch skips it for any
    # module with forward hooks), whose float32 rounding differs on some CPUs
    assert records[0]["test_loss"] == pytest.approx(records[2]["test_loss"], rel=1e-6)
    for record in records[1::2]:
        assert record["step"] == 2 and record["test_loss"] < records[0]["test_loss"]
        assert record["test_bpb"] == pytest.approx(record["test_loss"] / 0.6931471805599453)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["metric"] == "test_loss" and summary["dataset"] == "stdlib-text"
    settings = summary["settings"]["adamw"]
    assert settings["model"] == "gpt" and settings["lr"] == 3e-3 and not settings["eval_train"]
    assert "best test_loss" in (run / "table.md").read_text()


def test_lm_resume_is_bit_identical(tmp_path: Path) -> None:
    common = ["--compare", "adamw+kfac,kfac", "--kfac-inv-update-steps", "3"]
    assert main(_lm_args(tmp_path, *common, "--name", "split", "--epochs", "2")) == 0
    assert main(_lm_args(tmp_path, *common, "--name", "split", "--epochs", "3", "--resume")) == 0
    assert main(_lm_args(tmp_path, *common, "--name", "whole", "--epochs", "3")) == 0
    for config in ("adamw+kfac", "kfac"):
        split = torch.load(tmp_path / "split" / f"checkpoint-{config}.pt", weights_only=True)
        whole = torch.load(tmp_path / "whole" / f"checkpoint-{config}.pt", weights_only=True)
        assert split["epoch"] == whole["epoch"] == 3
        for key, value in whole["model"].items():
            assert torch.equal(split["model"][key], value), (config, key)


#: Record and checkpoint entries that are measured times (they differ between any two runs).
_TIMES = frozenset({"time", "wall", "seconds_per_iter", "kfac", "train_time"})


def _assert_same(a: object, b: object, where: str) -> None:
    """Bit-for-bit equality of checkpoint contents (tensors, NaN-aware floats), times aside."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            if key not in _TIMES:
                _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, float) and isinstance(b, float):
        assert a == b or (math.isnan(a) and math.isnan(b)), (where, a, b)
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fraction", [pytest.param("comm_opt", marks=pytest.mark.slow), "mem_opt"])
def test_lm_resume_under_torchrun_is_bit_identical(tmp_path: Path, fraction: str) -> None:
    """2 processes: 3 steps, --resume, 3 more equal 6 steps (checkpoints and metrics) for
    AdamW + KFACPreconditioner and kaisa.KFAC (Monte-Carlo curvature), resuming between
    two decomposition updates (every 4 steps) and two damping adaptations (every 5)."""
    configs = ("adamw+kfac", "kfac")
    common = ["--compare", ",".join(configs), "--steps-per-epoch", "3",
              "--kfac-inv-update-steps", "4", "--kfac-damping-interval", "5",
              "--kfac-grad-worker-fraction", fraction]
    for name, extra in (("split", ["--epochs", "1"]), ("split", ["--epochs", "2", "--resume"]),
                        ("whole", ["--epochs", "2"])):
        torchrun(2, _lm_args(tmp_path, *common, "--name", name, *extra),
                 log_dir=tmp_path / "stderr", timeout=200, cwd=ROOT)
    for config in configs:
        split = torch.load(tmp_path / "split" / f"checkpoint-{config}.pt", weights_only=True)
        whole = torch.load(tmp_path / "whole" / f"checkpoint-{config}.pt", weights_only=True)
        assert split["settings"]["world_size"] == whole["settings"]["world_size"] == 2
        assert split["epoch"] == whole["epoch"] == 2 and split["steps"] == 6
        _assert_same({k: v for k, v in split.items() if k != "settings"},
                     {k: v for k, v in whole.items() if k != "settings"}, config)
    split_records, whole_records = (
        [json.dumps({k: v for k, v in r.items() if k not in _TIMES}, sort_keys=True)
         for r in _records(tmp_path / run / "metrics.jsonl")] for run in ("split", "whole"))
    assert split_records == whole_records
    assert len(whole_records) == 2 * 3  # epochs 0, 1, 2 of each configuration


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--task", "lm", "--model", "cnn"], "--task lm needs --model gpt"),
        (["--task", "classify", "--model", "gpt"], "--task lm needs --model gpt"),
        (["--task", "classify", "--dataset", "stdlib-text"], "needs --dataset stdlib-text"),
        (["--task", "lm", "--dataset", "digits"], "needs --dataset stdlib-text"),
        (["--task", "lm", "--context", "0"], "must be >= 1"),
    ],
)
def test_lm_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--run-dir", str(tmp_path), "--quiet", *argv])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


# --- bench/convergence/gpt.py -----------------------------------------------------------------------


def test_bench_gpt_smoke(tmp_path: Path) -> None:
    module = load_bench("gpt")
    out = tmp_path / "gpt.json"
    only = "adamw@0.001,adamw@0.01,muon,soap,adamw+kfac,kfac@damping=0.1"
    payload = module.main(["--tiny", "--steps", "3", "--only", only, "--out", str(out),
                           "--text-bytes", "60000"])
    assert json.loads(out.read_text())["summary"] == payload["summary"]
    assert out.with_suffix(".png").stat().st_size > 0
    results = {r["config"]: r for r in payload["results"]}
    assert set(results) == set(only.split(","))
    initial = {r["curve"][0]["val_loss"] for r in results.values()}
    assert len(initial) == 1  # same initial weights everywhere
    for result in results.values():
        assert [p["step"] for p in result["curve"]][-1] == 3
        assert result["time_ratio_to_adamw"] > 0
    assert set(results["adamw+kfac"]["ms_per_step_by_phase"]) >= {"factors", "decompositions"}
    assert payload["summary"]["best_adamw"] in ("adamw@0.001", "adamw@0.01")
