"""Tensor codecs for model updates: quantizers, sparsifiers, low-rank, error feedback, wire.

    codec = get_codec("topk:0.01+int8")           # see _spec for the grammar
    data = codec.encode(tensor, seed=step)        # bytes; len(data) is the wire size
    tensor = decode(data, max_numel=10**8)        # DecodeError on any bad input
    ef = ErrorFeedback(codec)                     # residuals per name, checkpointable
    data = encode_named(model_params, codec, error_feedback=ef, seed=step)
    params = decode_named(data, max_numel=total_numel, device="cuda")

Nothing here logs or does I/O; randomness comes only from the seeds passed in.
"""

from ._base import Codec as Codec
from ._base import CodecState as CodecState
from ._base import decode as decode
from ._cast import BF16 as BF16
from ._cast import FP16 as FP16
from ._cast import NoneCodec as NoneCodec
from ._errors import DecodeError as DecodeError
from ._feedback import ErrorFeedback as ErrorFeedback
from ._lowbit import Int2 as Int2
from ._named import codec_family as codec_family
from ._named import decode_named as decode_named
from ._named import dense_named_payload as dense_named_payload
from ._named import encode_named as encode_named
from ._named import expected_nbytes_named as expected_nbytes_named
from ._powersgd import PowerSGD as PowerSGD
from ._quant import QSGD as QSGD
from ._quant import Int4 as Int4
from ._quant import Int8 as Int8
from ._quant import Sign as Sign
from ._sparse import RandK as RandK
from ._sparse import TopK as TopK
from ._spec import codec_names as codec_names
from ._spec import get_codec as get_codec
