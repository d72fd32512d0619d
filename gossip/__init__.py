"""The gossip protocol, sans-I/O: membership, link estimates, partner choice, averaging rules."""

from ._codec_choice import DEFAULT_LADDER as DEFAULT_LADDER
from ._codec_choice import choose_codec as choose_codec
from ._codec_choice import nominal_nbytes as nominal_nbytes
from ._consensus import consensus_distance as consensus_distance
from ._errors import GossipError as GossipError
from ._errors import LocalProtocolError as LocalProtocolError
from ._errors import RemoteProtocolError as RemoteProtocolError
from ._links import LinkConfig as LinkConfig
from ._links import LinkEstimate as LinkEstimate
from ._links import LinkTable as LinkTable
from ._membership import Membership as Membership
from ._membership import RttSample as RttSample
from ._membership import Send as Send
from ._membership_config import MembershipConfig as MembershipConfig
from ._membership_table import Member as Member
from ._membership_table import MembershipEvent as MembershipEvent
from ._membership_table import MemberState as MemberState
from ._messages import CLIENT_SCHEME as CLIENT_SCHEME
from ._messages import MESSAGE_TYPES as MESSAGE_TYPES
from ._messages import Ack as Ack
from ._messages import Join as Join
from ._messages import Leave as Leave
from ._messages import MembershipMessage as MembershipMessage
from ._messages import MemberUpdate as MemberUpdate
from ._messages import PeerList as PeerList
from ._messages import Ping as Ping
from ._messages import PingReq as PingReq
from ._messages import client_address as client_address
from ._messages import is_client_address as is_client_address
from ._messages import tcp_host_port as tcp_host_port
from ._messages import validate_message as validate_message
from ._netsim import MemoryNetwork as MemoryNetwork
from ._pacing import ExchangePacer as ExchangePacer
from ._partners import POLICIES as POLICIES
from ._partners import Candidates as Candidates
from ._partners import PartnerConfig as PartnerConfig
from ._partners import PartnerSelector as PartnerSelector
from ._scenarios import SCENARIOS as SCENARIOS
from ._scenarios import LinkProfile as LinkProfile
from ._scenarios import Scenario as Scenario
from ._simulator import PolicyResult as PolicyResult
from ._simulator import SimConfig as SimConfig
from ._simulator import compare_policies as compare_policies
from ._simulator import simulate as simulate

_AVERAGING = (
    "SLICE",
    "RejectedUpdate",
    "add_difference",
    "all_finite",
    "check_norm_ratio",
    "check_update",
    "distance",
    "distance_squared",
    "pairwise_mix",
    "params_norm",
)
_ALGORITHMS = (
    "NesterovOuter",
    "RoundAttendance",
    "average",
    "choco_consensus",
    "choco_difference",
    "choco_update_estimate",
    "fresh_deltas",
    "metropolis_hastings_weights",
    "neighbourhood_mix",
    "pseudo_gradient",
)
_CHOCO = ("ChocoLink", "ChocoLinks")
_SAMPLE = ("ModelSample",)
_ROBUST = (
    "ROBUST_RULES",
    "TRIM_MIN_NEIGHBOURS",
    "ClipRadius",
    "RobustStatistics",
    "clip_scale",
    "robust_average",
    "robust_scales",
    "clipped_neighbourhood_mix",
    "trim_count",
    "trimmed_mean_mix",
)


def __getattr__(name: str):
    # The averaging rules need torch; the protocol and the simulator do not. Importing them lazily
    # keeps `import geotrain.gossip` (and `python -m geotrain.gossip.sim`) free of torch's
    # start-up cost.
    if name in _AVERAGING:
        from . import _averaging

        return getattr(_averaging, name)
    if name in _ALGORITHMS:
        from . import _algorithms

        return getattr(_algorithms, name)
    if name in _CHOCO:
        from . import _choco

        return getattr(_choco, name)
    if name in _SAMPLE:
        from . import _sample

        return getattr(_sample, name)
    if name in _ROBUST:
        from . import _robust

        return getattr(_robust, name)
    raise AttributeError(f"module 'gossip' has no attribute {name!r}")
