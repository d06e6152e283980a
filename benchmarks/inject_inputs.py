"""Broken checkpoints and hostile inputs through the ``fp8lm`` command: each case must end as one
``fp8lm <command>: error:`` line on every rank (or run, where the input is valid), never as a
traceback, a hang or a silent run.

    python benchmarks/inject_inputs.py --classes sharded,hyperparameters,reference,numbers,data,resume_data

Classes (the cases of each are in `CASES`):

- ``sharded``: a 2-rank FP8 ZeRO (O3) and a 2-rank FSDP2 (O2 ``--fsdp``) run, each checkpointed,
  then the newest ``step_<n>.dcp`` broken one way (a zero-byte, truncated, random, missing or FIFO
  shard of rank 0 or 1, a zero-byte, random or truncated ``.metadata``, the folder missing or
  left empty) and ``--resume`` on 2 ranks, each rank's stderr read on its own;
- ``hyperparameters``: a param group's ``eps``/``weight_decay``/``lr``/``betas`` made non-finite
  or out of range in a ``.pt`` checkpoint (bf16, one process) and in the DCP optimizer state of
  the FSDP2 run, then ``--resume``;
- ``reference``: DPO's ``checkpoints/reference.pt`` with a NaN weight, zero bytes, random bytes,
  a changed shape, no options, a FIFO or missing, then ``fp8lm dpo --resume``;
- ``numbers``: ``--beta inf``/``nan``/``0``, ``--seed`` beyond 64 bits or negative, ``--device
  meta``/``cuda:7``, ``--batch-size``/``--eval-batches`` beyond memory;
- ``data``: pairs with an escaped lone surrogate, 100,000-deep nesting, a 5,000-digit integer
  (refused) and a raw U+2028 in a string (must run); a ``telemetry.jsonl`` that is not UTF-8;
- ``resume_data``: ``--resume`` after the ``--data`` file changed (one bit, same size and mtime;
  appended; replaced) (refused) or given by a relative path (must run).

A case "held" when the outcome is the expected one: one line per rank (every rank's stderr
exactly one ``error:`` line, no traceback), or a run that exits 0 for the valid inputs. Prints one
JSON object: per class the counts (held, refused in one line, traceback, hang, ran) and every case.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

from fp8lm.distributed.checkpoint import CheckpointReader  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
# absolute: some cases run the command from another folder
ENV["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p and os.path.isdir(p))
CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "email"
TIMEOUT_S = 240
TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1", "--no-progress"]
TINY += ["--telemetry-every", "0"]


# -- running the command ---------------------------------------------------------------------------


def fp8lm(args: list[str], ranks: int = 1, cwd: Path | None = None) -> list[tuple[int | None, str]]:
    """``fp8lm ARGS`` on ``ranks`` processes (torchrun's environment, each rank's stderr kept
    apart); (exit code, stderr) per rank, exit code None for a rank that hung past the timeout.
    As torchrun's agent does, this process serves the ranks' rendezvous store on a port it holds
    (a port found free and handed to rank 0 could be taken before rank 0 listens on it)."""
    procs = []
    if ranks > 1:  # kept until the ranks end
        store = torch.distributed.TCPStore("127.0.0.1", 0, ranks, is_master=True, wait_for_workers=False)
    for r in range(ranks):
        env = dict(ENV)
        if ranks > 1:
            env.update(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(ranks),
                LOCAL_WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store.port),
                TORCHELASTIC_USE_AGENT_STORE="True",
            )
        cmd = [sys.executable, "-m", "fp8lm.cli", *args]
        procs.append(subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    results = []
    for p in procs:
        try:
            results.append((p.wait(timeout=TIMEOUT_S), p.stderr.read().decode(errors="replace")))
        except subprocess.TimeoutExpired:
            p.kill()
            results.append((None, p.stderr.read().decode(errors="replace")))
    return results


def outcome(results: list[tuple[int | None, str]], should_run: bool) -> dict:
    """What the ranks did: ``hang``, ``traceback``, ``ran``, ``refused_in_one_line`` or ``other``;
    ``held`` when that is what the case should do."""
    if any(code is None for code, _ in results):
        kind = "hang"
    elif any("Traceback" in err for _, err in results):
        kind = "traceback"
    elif all(code == 0 for code, _ in results):
        kind = "ran"
    elif all(code == 2 and _one_error_line(err) for code, err in results):
        kind = "refused_in_one_line"
    else:
        kind = "other"
    held = kind == ("ran" if should_run else "refused_in_one_line")
    first = next((err.strip().splitlines()[-1] for _, err in results if err.strip()), "")
    first = re.sub(re.escape(tempfile.gettempdir()) + r"/tmp\w+", "ROOT", first)  # no machine's paths
    return {"outcome": kind, "held": held, "exit_codes": [c for c, _ in results], "line": first[:400]}


def _one_error_line(err: str) -> bool:
    lines = [line for line in err.splitlines() if line.strip()]
    return len(lines) == 1 and lines[0].startswith("fp8lm ") and ": error: " in lines[0]


# -- sharded checkpoints ---------------------------------------------------------------------------


def trained(root: Path, name: str, extra: list[str], ranks: int) -> Path:
    """A finished 2-step run checkpointed at each step (the one every case copies; made once)."""
    out = root / name
    if (out / "summary.json").exists():
        return out
    args = ["train", *TINY, "--steps", "2", "--save-every", "1", "--data", str(CORPUS)]
    args += ["--cache-dir", str(root / "cache"), "--out", str(out), *extra]
    codes = fp8lm(args, ranks)
    if any(code != 0 for code, _ in codes):
        raise SystemExit(f"the {name} run failed: {codes}")
    return out


def resume_args(out: Path, root: Path, extra: list[str]) -> list[str]:
    return ["train", *TINY, "--steps", "3", "--save-every", "1", "--data", str(CORPUS)] + [
        "--cache-dir",
        str(root / "cache"),
        "--out",
        str(out),
        "--resume",
        *extra,
    ]


def newest_shards(out: Path) -> Path:
    return sorted((out / "checkpoints").glob("step_*.dcp"))[-1]


def shard_of(rank: int) -> Callable[[Path], Path]:
    return lambda folder: folder / f"__{rank}_0.distcp"


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _randomize(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(path.stat().st_size))


def _emptied(folder: Path) -> None:  # what a kill in the old clean-up left
    shutil.rmtree(folder)
    folder.mkdir()


SHARD_BREAKS: dict[str, Callable[[Path], None]] = {}
for _rank in (0, 1):
    SHARD_BREAKS |= {
        f"zero-byte shard of rank {_rank}": lambda d, r=_rank: shard_of(r)(d).write_bytes(b""),
        f"truncated shard of rank {_rank}": lambda d, r=_rank: _truncate(shard_of(r)(d)),
        f"random shard of rank {_rank}": lambda d, r=_rank: _randomize(shard_of(r)(d)),
        f"missing shard of rank {_rank}": lambda d, r=_rank: shard_of(r)(d).unlink(),
        f"FIFO shard of rank {_rank}": lambda d, r=_rank: _fifo(shard_of(r)(d)),
    }
SHARD_BREAKS |= {
    "zero-byte .metadata": lambda d: (d / ".metadata").write_bytes(b""),
    "random .metadata": lambda d: _randomize(d / ".metadata"),
    "truncated .metadata": lambda d: _truncate(d / ".metadata"),
    "missing step_N.dcp folder": shutil.rmtree,
    "empty step_N.dcp folder": _emptied,
}
LAYOUTS = {"O3 (FP8 ZeRO)": ["--opt-level", "O3"], "O2 --fsdp (FSDP2)": ["--opt-level", "O2", "--fsdp"]}


def sharded_cases(root: Path) -> list[dict]:
    cases = []
    for layout, extra in LAYOUTS.items():
        run = trained(root, f"sharded-{extra[1]}", extra, 2)
        for name, breaks in SHARD_BREAKS.items():
            out = copy_run(run, root / "case")
            breaks(newest_shards(out))
            result = outcome(fp8lm(resume_args(out, root, extra), 2), should_run=False)
            cases.append({"layout": layout, "case": name, **result})
            print(json.dumps(cases[-1]), file=sys.stderr, flush=True)
    return cases


def copy_run(run: Path, to: Path) -> Path:
    shutil.rmtree(to, ignore_errors=True)
    shutil.copytree(run, to)
    return to


# -- hyper-parameters ------------------------------------------------------------------------------

INJECTIONS = {
    "eps = nan": ("eps", float("nan")),
    "eps = -1": ("eps", -1.0),
    "weight_decay = inf": ("weight_decay", float("inf")),
    "weight_decay = nan": ("weight_decay", float("nan")),
    "lr = nan": ("lr", float("nan")),
    "betas = (nan, 0.95)": ("betas", (float("nan"), 0.95)),
    "betas = (0.9, 1.5)": ("betas", (0.9, 1.5)),
}


def inject_pt(out: Path, key: str, value) -> None:
    path = sorted((out / "checkpoints").glob("step_*.pt"))[-1]
    state = torch.load(path, weights_only=True)
    for group in state["optimizer"]["param_groups"]:
        group[key] = value
    torch.save(state, path)


def inject_dcp(out: Path, key: str, value) -> None:
    """Rewrite the param groups' ``key`` entries of the newest DCP folder: the data file is written
    again with the new bytes and the metadata's offsets moved to match (as a hostile writer would)."""
    folder = newest_shards(out)
    metadata = CheckpointReader(str(folder)).read_metadata()
    targets = {i for i in metadata.storage_data if i.fqn.startswith("optim.param_groups.") and i.fqn.endswith(key)}
    files = {metadata.storage_data[i].relative_path for i in targets}
    for name in files:
        raw = (folder / name).read_bytes()
        items = sorted(
            (info.offset, index) for index, info in metadata.storage_data.items() if info.relative_path == name
        )
        rebuilt, position = bytearray(), 0
        for offset, index in items:
            info = metadata.storage_data[index]
            old_length = info.length
            rebuilt += raw[position:offset]
            chunk = raw[offset : offset + old_length]
            if index in targets:
                buffer = io.BytesIO()
                torch.save(value, buffer)
                chunk = buffer.getvalue()
            info.offset, info.length = len(rebuilt), len(chunk)
            rebuilt += chunk
            position = offset + old_length
        rebuilt += raw[position:]
        (folder / name).write_bytes(bytes(rebuilt))
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def hyperparameter_cases(root: Path) -> list[dict]:
    cases = []
    single = trained(root, "pt-bf16", ["--opt-level", "bf16"], 1)
    fsdp = trained(root, "sharded-O2", LAYOUTS["O2 --fsdp (FSDP2)"], 2)
    for name, (key, value) in INJECTIONS.items():
        out = copy_run(single, root / "case")
        inject_pt(out, key, value)
        result = outcome(fp8lm(resume_args(out, root, ["--opt-level", "bf16"])), should_run=False)
        cases.append({"layout": ".pt (bf16, one process)", "case": name, **result})
        out = copy_run(fsdp, root / "case")
        inject_dcp(out, key, value)
        result = outcome(fp8lm(resume_args(out, root, LAYOUTS["O2 --fsdp (FSDP2)"]), 2), should_run=False)
        cases.append({"layout": "DCP (O2 --fsdp, 2 ranks)", "case": name, **result})
        for c in cases[-2:]:
            print(json.dumps(c), file=sys.stderr, flush=True)
    return cases


# -- DPO's reference -------------------------------------------------------------------------------


def _edit_reference(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        saved = torch.load(path, weights_only=True)
        change(saved)
        torch.save(saved, path)

    return edit


def _nan(saved: dict) -> None:
    saved["model"]["lm_head.weight"][0, 0] = float("nan")


def _reshape(saved: dict) -> None:
    saved["model"]["wpe.weight"] = saved["model"]["wpe.weight"][:10]


REFERENCE_BREAKS: dict[str, Callable[[Path], None]] = {
    "NaN weight": _edit_reference(_nan),
    "zero bytes": lambda p: p.write_bytes(b""),
    "random bytes": lambda p: p.write_bytes(random.Random(0).randbytes(4096)),
    "shape changed": _edit_reference(_reshape),
    "options removed": _edit_reference(lambda s: s.pop("config")),
    "FIFO": _fifo,
    "missing": lambda p: p.unlink(),
}


def pairs_file(root: Path) -> Path:
    rng = random.Random(0)
    lines = []
    for _ in range(24):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}))
    path = root / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def dpo_args(root: Path, out: Path, *extra: str) -> list[str]:
    return ["dpo", "--data", str(pairs_file(root)), "--out", str(out), "--batch-size", "4", "--opt-level", "bf16"] + [
        "--no-progress",
        *extra,
    ]


def reference_cases(root: Path) -> list[dict]:
    base = trained(root, "pt-bf16", ["--opt-level", "bf16"], 1)
    run = root / "dpo"
    shutil.rmtree(run, ignore_errors=True)
    fp8lm(dpo_args(root, run, "--init-from", str(base), "--steps", "2"))
    cases = []
    for name, breaks in REFERENCE_BREAKS.items():
        out = copy_run(run, root / "case")
        breaks(out / "checkpoints" / "reference.pt")
        result = outcome(fp8lm(dpo_args(root, out, "--steps", "3", "--resume")), should_run=False)
        cases.append({"case": name, **result})
        print(json.dumps(cases[-1]), file=sys.stderr, flush=True)
    return cases


# -- CLI numbers -------------------------------------------------------------------------------------


def number_cases(root: Path) -> list[dict]:
    """Each case on a folder of its own; held only when the line names the option refused."""
    base = trained(root, "pt-bf16", ["--opt-level", "bf16"], 1)
    train = ["train", *TINY, "--steps", "1", "--data", str(CORPUS), "--cache-dir", str(root / "cache")]
    init = ["--init-from", str(base)]
    tried = [
        ("dpo --beta inf", "dpo", [*init, "--beta", "inf"], "--beta"),
        ("dpo --beta nan", "dpo", [*init, "--beta", "nan"], "--beta"),
        ("dpo --beta 0", "dpo", [*init, "--beta", "0"], "--beta"),
        ("dpo --batch-size 10**9", "dpo", [*init, "--batch-size", str(10**9)], "--batch-size"),
        ("train --seed 2**64 + 1", "train", ["--seed", str(2**64 + 1)], "--seed"),
        ("train --seed -1", "train", ["--seed", "-1"], "--seed"),
        ("train --device meta", "train", ["--device", "meta"], "meta"),
        ("train --device cuda:7", "train", ["--device", "cuda:7"], "cuda:7"),
        ("train --batch-size 10**8", "train", ["--batch-size", str(10**8)], "--batch-size"),
        ("train --eval-batches 10**9", "train", ["--eval-batches", str(10**9)], "--eval-batches"),
    ]
    cases = []
    for i, (name, command, extra, named) in enumerate(tried):
        out = root / f"numbers{i}"
        args = dpo_args(root, out, *extra) if command == "dpo" else [*train, "--out", str(out), *extra]
        result = outcome(fp8lm(args), should_run=False)
        result["held"] = result["held"] and named in result["line"]
        cases.append({"case": name, **result, "no_output_folder": not out.exists()})
        print(json.dumps(cases[-1]), file=sys.stderr, flush=True)
    return cases


# -- data files --------------------------------------------------------------------------------------


def data_cases(root: Path) -> list[dict]:
    base = trained(root, "pt-bf16", ["--opt-level", "bf16"], 1)
    good = pairs_file(root).read_text().splitlines()
    lines = {
        "escaped lone surrogate": ('{"prompt": "\\ud800", "chosen": "2", "rejected": "3"}', False),
        "100,000-deep nesting": ("[" * 100_000 + "]" * 100_000, False),
        "5,000-digit integer": ('{"prompt": "1", "chosen": "2", "rejected": "3", "n": ' + "9" * 5000 + "}", False),
        "raw U+2028 inside a string": (
            json.dumps({"prompt": "a\u2028b", "chosen": "2", "rejected": "3"}, ensure_ascii=False),
            True,
        ),
    }
    cases = []
    for name, (line, valid) in lines.items():
        path = root / "hostile.jsonl"
        path.write_text("\n".join([*good[:10], line, *good[10:]]) + "\n", encoding="utf-8")
        args = dpo_args(root, root / "d", "--init-from", str(base), "--steps", "1")
        args[args.index("--data") + 1] = str(path)
        shutil.rmtree(root / "d", ignore_errors=True)
        cases.append({"case": f"pairs: {name}", **outcome(fp8lm(args), should_run=valid)})
        print(json.dumps(cases[-1]), file=sys.stderr, flush=True)
    run = root / "inspect"
    run.mkdir(exist_ok=True)
    (run / "telemetry.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe not text\n')
    cases.append({"case": "inspect: telemetry.jsonl not UTF-8", **outcome(fp8lm(["inspect", str(run)]), False)})
    return cases


# -- --resume on changed data ------------------------------------------------------------------------


def _flip_keep_mtime(path: Path) -> None:
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _replace(path: Path) -> None:
    text = path.read_bytes()
    path.unlink()
    path.write_bytes(text[::-1])


DATA_CHANGES: dict[str, tuple[Callable[[Path], None] | None, bool]] = {
    "one bit flipped, same size and mtime": (_flip_keep_mtime, False),
    "bytes appended": (lambda p: p.open("ab").write(b"more text\n"), False),
    "file replaced by another": (_replace, False),
    "unchanged, given by a relative path": (None, True),
}


def resume_data_cases(root: Path) -> list[dict]:
    corpus = root / "corpus.txt"
    cases = []
    for name, (change, valid) in DATA_CHANGES.items():
        corpus.write_bytes(b"".join(p.read_bytes() for p in sorted(CORPUS.glob("*.py"))))
        out = root / "data-run"
        shutil.rmtree(out, ignore_errors=True)
        first = ["train", *TINY, "--steps", "2", "--data", str(corpus), "--cache-dir", str(root / "cache2")]
        fp8lm([*first, "--out", str(out)])
        data = str(corpus)
        if change is None:
            data = "corpus.txt"
        else:
            change(corpus)
        args = ["train", *TINY, "--steps", "3", "--data", data, "--cache-dir", str(root / "cache2")]
        args += ["--out", str(out), "--resume"]
        cases.append({"case": name, **outcome(fp8lm(args, cwd=root), should_run=valid)})
        print(json.dumps(cases[-1]), file=sys.stderr, flush=True)
    return cases


CLASSES = {
    "sharded": sharded_cases,
    "hyperparameters": hyperparameter_cases,
    "reference": reference_cases,
    "numbers": number_cases,
    "data": data_cases,
    "resume_data": resume_data_cases,
}


def totals(cases: list[dict]) -> dict:
    kinds = ("refused_in_one_line", "ran", "traceback", "hang", "other")
    return {"cases": len(cases), "held": sum(c["held"] for c in cases)} | {
        k: sum(c["outcome"] == k for c in cases) for k in kinds
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--classes", default=",".join(CLASSES), help=f"comma-separated, of {', '.join(CLASSES)}")
    args = p.parse_args()
    chosen = args.classes.split(",")
    report: dict = {"benchmark": "inject_inputs", "config": vars(args), "machine": machine(), "classes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in chosen:
            cases = CLASSES[name](root)
            report["classes"][name] = {"totals": totals(cases), "cases": cases}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
