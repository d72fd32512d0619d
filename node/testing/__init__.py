"""Testing a node's parts and whole swarms: what geotrain's own tests use, for yours too.

- In memory, on trio's clock: `open_memory_network()` gives peers that talk through memory (each
  request encoded as on the wire; delays, cuts and lost replies per link), `algorithm_on(...)`
  puts an algorithm's runtime on it with its tensor work inline, so a test on
  `trio.testing.MockClock(autojump_threshold=0)` sees exact virtual times.
- In processes: `LocalSwarm` writes configs and runs real `geotrain node run` processes on
  loopback (the same launcher and config writer as the testbed); with `fork_server=True` they
  fork from one warm process (`ForkServer`) instead of each importing torch afresh.
"""

from .._forkserver import ForkedProcess as ForkedProcess
from .._forkserver import ForkServer as ForkServer
from ._memory import MemoryNetwork as MemoryNetwork
from ._memory import MemoryTransport as MemoryTransport
from ._memory import StaticMembership as StaticMembership
from ._memory import algorithm_on as algorithm_on
from ._memory import open_memory_network as open_memory_network
from ._parts import PeerParts as PeerParts
from ._parts import header_codec as header_codec
from ._parts import peer_parts as peer_parts
from ._swarm import LocalSwarm as LocalSwarm
from ._swarm import SwarmNode as SwarmNode
