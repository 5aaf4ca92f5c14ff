"""The forge CLI with every checkpoint write announced and slowed down, so a test can kill it mid-save.

Each DCP write appends the checkpoint folder to $FORGE_TEST_SAVE_MARKER, then waits 0.2 s before writing.
"""

import os
import sys
import time

from torch.distributed.checkpoint import FileSystemWriter

from forgecli.app import main

original_write = FileSystemWriter.write_data


def announced_slow_write(self, plan, planner):
    with open(os.environ["FORGE_TEST_SAVE_MARKER"], "a") as marker:
        marker.write(f"{self.path}\n")
    time.sleep(0.2)
    return original_write(self, plan, planner)


FileSystemWriter.write_data = announced_slow_write

if __name__ == "__main__":
    sys.argv[0] = "forge"
    main()
