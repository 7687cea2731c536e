"""Every rank prints 'tick N' every 0.3 s for --seconds (default 60): a slow job to watch and interrupt."""
import os
import sys
import time

seconds = float(sys.argv[sys.argv.index("--seconds") + 1]) if "--seconds" in sys.argv else 60.0
rank = int(os.environ.get("RANK", "0"))
for tick in range(int(seconds / 0.3)):
    print(f"tick {tick} from rank {rank}", flush=True)
    time.sleep(0.3)
