"""Who a node is and whom it lets in: Ed25519 identities, swarm authorities, admission."""

from ._admission import Admission as Admission
from ._admission import AdmissionRefused as AdmissionRefused
from ._admission import MembershipCertificate as MembershipCertificate
from ._admission import SwarmAuthority as SwarmAuthority
from ._admission import SwarmInfo as SwarmInfo
from ._identity import PUBLIC_KEY_BYTES as PUBLIC_KEY_BYTES
from ._identity import SIGNATURE_BYTES as SIGNATURE_BYTES
from ._identity import Identity as Identity
from ._identity import KeyFileError as KeyFileError
from ._identity import peer_id_from_public_key as peer_id_from_public_key
from ._identity import public_key_from_peer_id as public_key_from_peer_id
from ._identity import short_id as short_id
from ._identity import verify_signature as verify_signature
