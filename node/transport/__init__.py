"""The secure request/response transport: Noise XX over pynng, typed headers, raw payloads.

    async with open_transport(TransportConfig(listen=...), identity, admission, handler,
                              codec=HeaderCodec(types)) as transport:
        reply, payload, peer = await transport.request(address, header, data, deadline_s=2.0)

Only this package imports pynng, and no pynng exception leaves it: callers see TransportError.
"""

from ._messages import HEADER_TYPES as HEADER_TYPES
from ._messages import PROTOCOL_VERSION as PROTOCOL_VERSION
from ._messages import U63 as U63
from ._messages import CodecSpec as CodecSpec
from ._messages import ErrorCode as ErrorCode
from ._messages import ErrorReply as ErrorReply
from ._messages import Header as Header
from ._messages import HeaderCodec as HeaderCodec
from ._messages import HeaderDecodeError as HeaderDecodeError
from ._messages import Name as Name
from ._messages import Ping as Ping
from ._messages import Pong as Pong
from ._noise import frame_length as frame_length
from ._transport import Transport as Transport
from ._transport import open_raw_pynng_exchange as open_raw_pynng_exchange
from ._transport import open_raw_pynng_pair as open_raw_pynng_pair
from ._transport import open_transport as open_transport
from ._types import Handler as Handler
from ._types import HandshakeError as HandshakeError
from ._types import ListenError as ListenError
from ._types import LocalTransportError as LocalTransportError
from ._types import PeerInfo as PeerInfo
from ._types import PeerUnreachable as PeerUnreachable
from ._types import RemoteTransportError as RemoteTransportError
from ._types import RequestTimeout as RequestTimeout
from ._types import TransportConfig as TransportConfig
from ._types import TransportError as TransportError
from ._types import TransportStatistics as TransportStatistics
from ._types import dialable as dialable
