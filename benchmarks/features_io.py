"""Feature shards: write and read MB/s of safetensors (FeatureExtractor's) against torch.save, same tensors;
peak memory of ``load_features(mmap=True)`` on a set larger than a memory budget.

    python benchmarks/features_io.py                 # 128 MB per round, a 768 MB set, a 192 MB budget
    python benchmarks/features_io.py --mb 64 --set-mb 256 --budget-mb 96

Throughput: each round writes the same shards (float32 rows of 768 values plus int64 sample
ids, 8 MB a shard) once per format, in alternating order, then reads them back; the median over
rounds is reported, with each format's ratio to ``torch.save`` within the same round (ratios hold
on a loaded machine, absolute MB/s do not). Reads come from a warm page cache.

Memory: a child process builds nothing; it opens the set with ``load_features(mmap=True)``,
streams every row through in chunks of 1024 (3 MB) (a mean over the set), and looks up 1000 random
sample ids; a sampling thread records its peak anonymous memory (``RssAnon``: what cannot be
reclaimed) and its peak RSS (``VmHWM``, which also counts file pages of the mapping the kernel
may drop). The same with ``load_features()`` (everything in memory) for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from lightning_hooks import load_features  # noqa: E402
from lightning_hooks.output._feature_reader import read_tensor  # noqa: E402
from lightning_hooks.output._feature_store import ShardWriter, write_manifest  # noqa: E402

ROWS, WIDTH = 2730, 768  # 8 MB of float32 features per shard (and 21 KB of ids)
FOLDERS = {"safetensors (ours)": "safetensors", "torch.save": "torch", "torch.save + fsync": "torch-fsync"}


def shards(total_mb: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    count = max(1, total_mb * 2**20 // (ROWS * WIDTH * 4))
    return [(torch.randn(ROWS, WIDTH, generator=generator), torch.arange(k * ROWS, (k + 1) * ROWS))
            for k in range(count)]


def timed(action: Callable[..., object], *args: object, **kwargs: object) -> float:
    start = time.perf_counter()
    action(*args, **kwargs)
    return time.perf_counter() - start


def write_safetensors(folder: Path, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    writer = ShardWriter(folder, "predict", rank=0, world_size=1)  # temp name + rename, fsync, CRC-32
    for features, ids in data:
        writer.write({"x": features}, {"x": ids}, dataloader=0)
    writer.finish()
    write_manifest(folder, "predict", 1, {})


def write_torch(folder: Path, data: list[tuple[torch.Tensor, torch.Tensor]], fsync: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for k, (features, ids) in enumerate(data):
        path = folder / f"shard{k:05d}.pt"
        torch.save({"features": features, "ids": ids}, path)
        if fsync:
            with open(path, "rb+") as file:
                os.fsync(file.fileno())


def read_torch(folder: Path) -> torch.Tensor:
    return torch.cat([torch.load(p, weights_only=True)["features"] for p in sorted(folder.glob("*.pt"))])


def read_shards(folder: Path) -> torch.Tensor:
    return torch.cat([read_tensor(p, "features/x", mmap=False) for p in sorted(folder.glob("*.safetensors"))])


def throughput(total_mb: int, rounds: int, root: Path) -> None:
    data = shards(total_mb)
    megabytes = sum(f.nbytes + i.nbytes for f, i in data) / 2**20
    writes: dict[str, list[float]] = {"safetensors (ours)": [], "torch.save": [], "torch.save + fsync": []}
    reads: dict[str, list[float]] = {"load_features": [], "load_features(mmap=True)[:]": [],
                                     "safetensors, shard by shard": [], "torch.load(weights_only=True)": []}
    for r in range(rounds):
        order = list(writes) if r % 2 == 0 else list(reversed(writes))
        for name in order:
            folder = root / f"{r}-{FOLDERS[name]}"
            if name.startswith("safetensors"):
                seconds = timed(write_safetensors, folder, data)
            else:
                seconds = timed(write_torch, folder, data, fsync="fsync" in name)
            writes[name].append(megabytes / seconds)
        ours, theirs = root / f"{r}-safetensors", root / f"{r}-torch"
        reads["load_features"].append(megabytes / timed(load_features, ours, "x"))
        reads["load_features(mmap=True)[:]"].append(megabytes / timed(lambda d: load_features(d, "x", mmap=True)[:],
                                                                      ours))
        reads["safetensors, shard by shard"].append(megabytes / timed(read_shards, ours / "predict"))
        reads["torch.load(weights_only=True)"].append(megabytes / timed(read_torch, theirs))
    report(f"write, {megabytes:.0f} MB in {len(data)} shards", writes, "torch.save")
    report(f"read, {megabytes:.0f} MB (warm page cache)", reads, "torch.load(weights_only=True)")


def report(title: str, results: dict[str, list[float]], baseline: str) -> None:
    print(f"\n| {title} | MB/s (median of {len(results[baseline])}) | ratio to {baseline} (median per round) |")
    print("| --- | ---: | ---: |")
    for name, values in results.items():
        ratio = statistics.median(v / b for v, b in zip(values, results[baseline]))
        print(f"| {name} | {statistics.median(values):.0f} | {ratio:.2f} |")


def peak_memory_child(folder: str, mmap: bool) -> None:
    """Run in a child: open the set, stream it, look ids up; print peak RssAnon and VmHWM in MB."""
    peak = {"RssAnon": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak["RssAnon"] = max(peak["RssAnon"], status("RssAnon"))
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = status("RssAnon")
    features = load_features(folder, "x", mmap=mmap)
    total = torch.zeros(features.shape[1], dtype=torch.float64)
    for begin in range(0, len(features), 1024):
        total += features[begin: begin + 1024].double().sum(0)
    wanted = torch.randint(0, len(features), (1000,), generator=torch.Generator().manual_seed(0))
    looked_up = features.by_id(wanted) if mmap else features[wanted]
    done.set()
    thread.join()
    print(f"{start / 1024:.0f} {peak['RssAnon'] / 1024:.0f} {status('VmHWM') / 1024:.0f} {looked_up.shape[0]}")


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])  # kB
    raise KeyError(field)


def peak_memory(set_mb: int, budget_mb: int, root: Path) -> None:
    folder = root / "big"
    write_safetensors(folder, shards(set_mb, seed=1))
    size = sum(p.stat().st_size for p in (folder / "predict").glob("*.safetensors")) / 2**20
    print(f"\n| a {size:.0f} MB set, budget {budget_mb} MB | anonymous memory before | peak anonymous"
          " (RssAnon) | peak RSS (VmHWM) | within budget |")
    print("| --- | ---: | ---: | ---: | --- |")
    for mmap in (True, False):
        out = subprocess.run([sys.executable, __file__, "--child", str(folder), str(int(mmap))],
                             capture_output=True, text=True, check=True).stdout.split()
        before, anon, hwm = (float(v) for v in out[:3])
        name = "load_features(mmap=True)" if mmap else "load_features()"
        print(f"| {name} | {before:.0f} MB | {anon:.0f} MB | {hwm:.0f} MB |"
              f" {'yes' if anon - before < budget_mb else 'no'} ({anon - before:.0f} MB above the start) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=128, help="MB written per format per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--set-mb", type=int, default=768, help="size of the set for the memory test")
    parser.add_argument("--budget-mb", type=int, default=192, help="the memory budget it must stay within")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return peak_memory_child(args.child[0], bool(int(args.child[1])))
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=os.environ.get("FEATURES_BENCH_DIR")) as root:
        throughput(args.mb, args.rounds, Path(root))
        peak_memory(args.set_mb, args.budget_mb, Path(root))


if __name__ == "__main__":
    main()
