"""The time to parse and validate the largest spec there may be (1 MiB), against yaml.load.

    python bench/spec_parse.py --rounds 5

Three 1 MiB specs whose bulk is a model argument: a list of integers, a list of
short strings, and a list of small mappings. Each contender runs interleaved
over the rounds; figures are medians. "yaml.load" is PyYAML's own load with
libyaml (CSafeLoader) followed by the same validation, without the bounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import yaml

from gpipe.coordinator.spec.job import MAX_SPEC_BYTES, JobSpec, parse_spec

HEAD = "name: big\nstages: 2\ndata: {factory: random_regression, batch_size: 4}\n" \
       "optimizer: {name: sgd, lr: 0.1}\nsteps: 2\nmodel: {factory: mlp, args: {width: 8, depth: 3, bulk: ["
TAIL = "]}}\n"


def spec_of(item: str) -> str:
    """HEAD, as many copies of `item` as fit in 1 MiB, TAIL."""
    n = (MAX_SPEC_BYTES - len(HEAD) - len(TAIL)) // (len(item) + 2)
    return HEAD + ", ".join([item] * n) + TAIL


def timed(f, text: str) -> float:
    t = time.perf_counter()
    f(text)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    rounds = ap.parse_args().rounds
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    contenders = {
        "parse_spec": parse_spec,
        f"yaml.load ({loader.__name__}) + validate": lambda t: JobSpec.model_validate(yaml.load(t, Loader=loader)),
    }
    for label, item in [("integers", "123456"), ("strings", "abcdef"), ("mappings", "{name: layer, width: 1024}")]:
        text = spec_of(item)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(rounds):
            for name, f in contenders.items():
                times[name].append(timed(f, text))
        med = {name: statistics.median(ts) for name, ts in times.items()}
        base = med["parse_spec"]
        print(f"{len(text.encode())} bytes of {label}: "
              + ", ".join(f"{name} {s * 1000:.0f} ms ({s / base:.2f}x)" for name, s in med.items()))


if __name__ == "__main__":
    main()
