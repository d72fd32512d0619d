"""The gossip algorithms a node runs: one public module each, registered by name.

Adding an algorithm is adding one module here that defines its messages, its settings table
([gossip.<name>]), its runtime (a subclass of `Algorithm`) and calls `register_algorithm` once;
the node, the config and the transport pick it up from the registry.
"""

from ._base import MODEL_CODECS as MODEL_CODECS
from ._base import Algorithm as Algorithm
from ._base import AlgorithmContext as AlgorithmContext
from ._base import AlgorithmSpec as AlgorithmSpec
from ._base import ExchangeCounters as ExchangeCounters
from ._base import ExchangeStatistics as ExchangeStatistics
from ._base import Network as Network
from ._base import PeerExchangeStatistics as PeerExchangeStatistics
from ._base import Tensors as Tensors
from ._base import ToThread as ToThread
from ._base import decode_model as decode_model
from ._base import inline as inline
from ._registry import algorithm_messages as algorithm_messages
from ._registry import algorithm_specs as algorithm_specs
from ._registry import get_algorithm as get_algorithm
from ._registry import register_algorithm as register_algorithm
from ._stream import CHUNKS_IN_FLIGHT as CHUNKS_IN_FLIGHT
from ._stream import MAX_CHUNKS as MAX_CHUNKS
from ._stream import MODELS_DIFFER as MODELS_DIFFER
from ._stream import WINDOW_BYTES as WINDOW_BYTES
from ._stream import ChunkPlan as ChunkPlan
from ._stream import ModelAssembly as ModelAssembly
from ._stream import PairwiseMix as PairwiseMix
from ._stream import SliceFeedback as SliceFeedback
from ._stream import cached_plan as cached_plan
from ._stream import chunks_in_flight as chunks_in_flight
from ._stream import decode_chunk as decode_chunk
from ._stream import encode_chunk as encode_chunk
from ._stream import in_window as in_window
from ._stream import model_chunk as model_chunk
from ._stream import plan_refusal as plan_refusal
from ._stream import read_chunk as read_chunk
from ._stream import read_chunk_encoded as read_chunk_encoded
from ._stream import slow_start_s as slow_start_s
from ._stream import window_chunks as window_chunks
