"""`tcoll run`: start the ranks of a job on this node, forward their output, stop them together.

The command line (`tcoll.cli`) only parses arguments into a `LaunchConfig` and
calls `launch`; everything else lives here so it can be called from Python too.

Owns: spawning and watching rank processes, output prefixing, multi-node coordination, leftover sweeping.
May import: store, segments and the leaves (a launcher never runs a communicator itself).
"""

from tcoll.launch.config import LaunchConfig, new_run_id, parse_master
from tcoll.launch.process import remove_shm_segments
from tcoll.launch.runner import LaunchError, launch

__all__ = ["LaunchConfig", "LaunchError", "launch", "new_run_id", "parse_master", "remove_shm_segments"]
