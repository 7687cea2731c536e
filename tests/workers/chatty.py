"""Each rank prints many numbered lines, on stdout and stderr, as fast as it can."""
import os
import sys

rank, lines = int(os.environ["RANK"]), int(sys.argv[1])
for i in range(lines):
    stream = sys.stderr if i % 10 == 0 else sys.stdout
    print(f"rank={rank} line={i:06d} " + "x" * 60, file=stream)
