"""The gossip protocol, sans-I/O: membership, link estimates, partner choice, averaging rules."""

from ._averaging import RejectedUpdate as RejectedUpdate
from ._averaging import check_update as check_update
from ._averaging import pairwise_mix as pairwise_mix
from ._averaging import params_norm as params_norm
from ._errors import GossipError as GossipError
from ._errors import LocalProtocolError as LocalProtocolError
from ._errors import RemoteProtocolError as RemoteProtocolError
from ._membership import Membership as Membership
from ._membership import RttSample as RttSample
from ._membership import Send as Send
from ._membership_config import MembershipConfig as MembershipConfig
from ._membership_table import Member as Member
from ._membership_table import MembershipEvent as MembershipEvent
from ._membership_table import MemberState as MemberState
from ._messages import Ack as Ack
from ._messages import Join as Join
from ._messages import Leave as Leave
from ._messages import MembershipMessage as MembershipMessage
from ._messages import MemberUpdate as MemberUpdate
from ._messages import PeerList as PeerList
from ._messages import Ping as Ping
from ._messages import PingReq as PingReq
from ._messages import validate_message as validate_message
from ._netsim import MemoryNetwork as MemoryNetwork
