"""Every rank sleeps; with --ignore-sigterm it also ignores SIGTERM. Prints 'sleeping' once ready."""
import signal
import sys
import time

if "--ignore-sigterm" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("sleeping", flush=True)
time.sleep(120)
