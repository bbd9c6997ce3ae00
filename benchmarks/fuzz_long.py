"""Longer fuzzing of the safetensors header reader and the manifest readers than CI runs.

    python benchmarks/fuzz_long.py --target safetensors --seconds 600 [--engine atheris|mutate]
    python benchmarks/fuzz_long.py --target manifest --seconds 600

Same targets and contract as tests/reliability (fuzz_targets.py): every input parses consistently or raises a
GlmPackError; anything else is a crash (atheris prints the input and exits non-zero). Engines: ``atheris``
(coverage-guided libFuzzer, when ``pip install atheris`` works; seeded with a valid file / a real manifest)
or ``mutate`` (the seeded mutators of the CI tests, for as long as asked). Memory is capped with
RLIMIT_AS at the process size after imports plus ``--memory-mb``, so a parser that allocates by a claimed
length fails loudly instead of swapping. Prints the number of inputs tried.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))

TARGETS = ("safetensors", "manifest")


def seed_inputs(target: str) -> list[bytes]:
    """A valid safetensors file, or the manifest of a small synthetic conversion (MLA + repacked experts)."""
    if target == "safetensors":
        import torch
        from safetensors.torch import save

        tensors = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, 5, dtype=torch.bfloat16)}
        return [save({**tensors, "c": torch.arange(7, dtype=torch.uint8)}, metadata={"format": "pt"})]
    from glm_pack.convert.convert import ConvertOptions, convert
    from glm_pack.convert.synth import synthesize

    root = Path(tempfile.mkdtemp(prefix="glm-pack-fuzz-"))
    src = synthesize(root / "src", card="glm-5", layers=4, experts=2, fmt="mxfp4-quark", profile="small", seed=0)
    convert(src, root / "out", ConvertOptions(files="none", repack_experts="aiter-a4w4"))
    return [(root / "out" / "glm-pack" / "manifest.json").read_bytes()]


def cap_memory(extra_mb: int) -> None:
    with open("/proc/self/statm") as f:
        vm_bytes = int(f.read().split()[0]) * resource.getpagesize()
    limit = vm_bytes + extra_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def run_mutate(target: str, seeds: list[bytes], seconds: float, seed: int) -> None:
    import fuzz_targets as ft

    rng = random.Random(seed)
    check = ft.safetensors_target if target == "safetensors" else ft.manifest_target
    mutate = (lambda: ft.mutate_bytes(seeds[0], rng)) if target == "safetensors" else None
    if target == "manifest":
        text = seeds[0].decode()
        mutate = lambda: ft.mutate_manifest(text, rng)  # noqa: E731
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(200):
            check(mutate())
    print(f"mutate engine, {seconds:.0f} s, seed {seed}: inputs tried {dict(sorted(ft.COUNTS.items()))}")


def run_atheris(target: str, seeds: list[bytes], seconds: float, libfuzzer_args: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["glm_pack"]):
        import glm_pack.convert.safetensors_io  # noqa: F401
        import glm_pack.packing.manifest  # noqa: F401
    import fuzz_targets as ft

    check = ft.safetensors_target if target == "safetensors" else ft.manifest_target
    corpus = Path(tempfile.mkdtemp(prefix=f"glm-pack-corpus-{target}-"))
    for i, data in enumerate(seeds):
        (corpus / f"seed-{i}").write_bytes(data)
    argv = [sys.argv[0], str(corpus), f"-max_total_time={int(seconds)}", "-rss_limit_mb=0", *libfuzzer_args]
    atheris.Setup(argv, lambda data: check(bytes(data)))
    atheris.Fuzz()  # libFuzzer prints "Done N runs in S second(s)" and exits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=TARGETS, required=True)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--engine", choices=("atheris", "mutate"), default=None, help="default: atheris if installed")
    ap.add_argument("--seed", type=int, default=1, help="mutate engine's random seed")
    ap.add_argument("--memory-mb", type=int, default=2048, help="address space allowed beyond the start")
    args, libfuzzer_args = ap.parse_known_args()
    engine = args.engine
    if engine is None:
        try:
            import atheris  # noqa: F401

            engine = "atheris"
        except ImportError:
            engine = "mutate"
    seeds = seed_inputs(args.target)
    import torch  # noqa: F401  (imported before the cap: its start-up mappings are not what is measured)

    cap_memory(args.memory_mb)
    if engine == "atheris":
        run_atheris(args.target, seeds, args.seconds, libfuzzer_args)
    else:
        run_mutate(args.target, seeds, args.seconds, args.seed)


if __name__ == "__main__":
    main()
