"""Cut links across hosts, several rounds: how long to notice, how long to train again, and how often it ends well.

Each round runs tests/service/test_multihost.py: serve and three workers in four
network namespaces, started from the rendered cpu overlay; one worker's link
is cut for 20 s, then the coordinator's for 15 s; the round passes when the
job ends SUCCEEDED on the one-device weights. Prints each round's figures and
the medians: from the cut to RESTARTING, and from the mend to the next
trained step. Needs root (network namespaces).

    python bench/partition.py --rounds 5
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    cut, back, passed = [], [], 0
    for n in range(1, a.rounds + 1):
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                            "tests/service/test_multihost.py"], cwd=ROOT, capture_output=True, text=True, timeout=900)
        m = re.search(r"link cut -> RESTARTING ([\d.]+)s; mended -> next trained step ([\d.]+)s", r.stderr + r.stdout)
        ok = r.returncode == 0 and m is not None
        passed += ok
        if m:
            cut.append(float(m[1]))
            back.append(float(m[2]))
        print(f"round {n}: {'SUCCEEDED, same weights' if ok else 'FAILED'}"
              + (f"; cut -> RESTARTING {m[1]}s, mend -> next step {m[2]}s" if m else ""), flush=True)
        if not ok:
            print((r.stdout + r.stderr)[-3000:], file=sys.stderr)
    print(f"\n{passed} of {a.rounds} rounds ended SUCCEEDED on the uninterrupted weights")
    if cut:
        print(f"median: link cut -> RESTARTING {statistics.median(cut):.1f}s, "
              f"mended -> next trained step {statistics.median(back):.1f}s")


if __name__ == "__main__":
    main()
