"""The on-disk format (versions 1 to 4): names, shard header, manifest and its validation.

Everything read back from storage is untrusted: :func:`parse_manifest` and :func:`parse_header`
check every field before a byte range is used. This package imports neither torch nor fsspec,
so the daemon and the CLI stay light. Its parts: :mod:`.names` (versions, constants, step and
shard names), :mod:`.header` (a shard's safetensors header), :mod:`.manifest` (the manifest
read back and checked) and :mod:`.encode` (the manifest written). Everything is used through
this package (``from aiockpt._core import format as fmt``).
"""

from __future__ import annotations

from ..dtypes import DTYPE_SIZES as DTYPE_SIZES
from ..tree import check_tree as check_tree
from ..values import MAX_METADATA_DEPTH as MAX_METADATA_DEPTH
from ..values import MAX_TREE_DEPTH as MAX_TREE_DEPTH
from .encode import encode_tree as encode_tree
from .encode import fragment_ref as fragment_ref
from .encode import manifest_json as manifest_json
from .encode import tensors_json as tensors_json
from .encode import tensors_json_parts as tensors_json_parts
from .encode import tree_version as tree_version
from .header import TensorSpec as TensorSpec
from .header import build_header as build_header
from .header import header_json as header_json
from .header import header_length as header_length
from .header import parse_header as parse_header
from .manifest import Manifest as Manifest
from .manifest import ShardRecord as ShardRecord
from .manifest import ShardTensors as ShardTensors
from .manifest import TensorRecord as TensorRecord
from .manifest import check_header_agrees as check_header_agrees
from .manifest import parse_manifest as parse_manifest
from .manifest import parse_manifest_head as parse_manifest_head
from .manifest import parse_manifest_record as parse_manifest_record
from .names import ALIGN as ALIGN
from .names import DTENSOR_VERSION as DTENSOR_VERSION
from .names import FORMAT as FORMAT
from .names import MANIFEST as MANIFEST
from .names import MAX_HEADER_BYTES as MAX_HEADER_BYTES
from .names import MAX_NDIM as MAX_NDIM
from .names import NAMES_VERSION as NAMES_VERSION
from .names import PAD_NAME as PAD_NAME
from .names import REFS_VERSION as REFS_VERSION
from .names import TAG_DIGITS as TAG_DIGITS
from .names import VERSION as VERSION
from .names import VERSIONS as VERSIONS
from .names import align_up as align_up
from .names import new_tag as new_tag
from .names import parse_shard_filename as parse_shard_filename
from .names import parse_step_dirname as parse_step_dirname
from .names import shard_filename as shard_filename
from .names import step_dirname as step_dirname
