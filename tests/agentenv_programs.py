"""Programs the agentenv limit tests run inside a sandbox (plain module: the VM guest imports it with the
system python, which has no pytest)."""

# Forks sleeping children until fork() fails; prints how many it made and the errno (0: never failed).
FORK_COUNT = r"""
import os, time
n = 0
try:
    while n < 1000:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    print(n, e.errno)
else:
    print(n, 0)
"""
# Allocates 1 MiB at a time, printing the count, until the memory limit kills it.
BOMB = "x = []\nwhile True:\n    x.append(bytearray(1 << 20))\n    print(len(x), flush=True)\n"
