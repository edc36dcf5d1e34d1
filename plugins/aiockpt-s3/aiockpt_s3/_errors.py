"""What S3's failures mean: which ones a retry may cure, and the StorageError each becomes."""

from __future__ import annotations

import asyncio
import errno as errno_mod

# aiohttp is what aiobotocore sends with; its errors can escape botocore's wrapping.
from aiohttp import ClientError as _AiohttpError
from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.parsers import ResponseParserError

from aiockpt.errors import StorageError
from aiockpt.storage.objects import GaveUp, failed

#: Error codes S3 (and S3-compatible servers) answer when a retry may succeed.
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "PriorRequestNotComplete",
        "XAmzContentSHA256Mismatch",  # the body was damaged on the way
        "BadDigest",
    }
)


def error_code(e: BaseException) -> tuple[str, int]:
    """S3's error code and HTTP status in ``e``; ``("", 0)`` when S3 did not answer."""
    if isinstance(e, ClientError):
        err = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return str(err.get("Code", "")), int(status)
    return "", 0


def is_transient(e: BaseException) -> bool:
    """Whether a retry of the request that raised ``e`` may succeed."""
    if isinstance(e, ClientError):
        code, status = error_code(e)
        return code in TRANSIENT_CODES or status >= 500 or status == 429
    return isinstance(
        e,
        (
            HTTPClientError,  # connection reset/closed, read timeouts
            BotoConnectionError,  # connection refused, connect timeouts
            IncompleteReadError,
            ResponseParserError,  # throttling answers are sometimes not XML
            _AiohttpError,
            ConnectionError,
            TimeoutError,
            asyncio.TimeoutError,
        ),
    )


def is_precondition_failed(e: BaseException) -> bool:
    """Whether ``e`` is S3 refusing a conditional request (412: ``If-None-Match: *`` met an
    object that is there)."""
    code, status = error_code(e)
    return status == 412 or code == "PreconditionFailed"


def exists_error(where: str) -> StorageError:
    """The failure of a write onto an object that is there already: writes create, and
    never replace (``errno.EEXIST``)."""
    return StorageError(
        f"create {where} failed: an object is there already (a write never replaces one)",
        path=where,
        errno=errno_mod.EEXIST,
    )


def no_such_bucket(op: str, key: str) -> GaveUp:
    """The failure of a request on ``key`` whose bucket turned out not to exist."""
    return GaveUp(op, key, ClientError({"Error": {"Code": "NoSuchBucket"}}, "HeadBucket"), 1)


def storage_error(
    op: str, where: str, bucket: str, e: BaseException, attempts: int
) -> StorageError:
    """The StorageError that tells the caller ``op`` on ``where`` failed because of ``e``."""
    return failed(op, where, e, attempts, _reason(e, bucket))


def _reason(e: BaseException, bucket: str) -> tuple[str, int] | None:
    """What went wrong, in words, and the errno that says it; None where ``e`` says it."""
    code, status = error_code(e)
    if code == "NoSuchBucket":
        return f"the bucket {bucket!r} does not exist", errno_mod.ENOENT
    if code in ("NoSuchKey", "404", "NotFound") or status == 404:
        return "no such object", errno_mod.ENOENT
    if code in ("AccessDenied", "403", "Forbidden") or status == 403:
        return f"access denied ({e})", errno_mod.EACCES
    if code == "InvalidRange":
        return "the object ends before the requested range", errno_mod.EIO
    if code == "PreconditionFailed" or status == 412:  # a read's If-Match: another version
        return "the object changed while it was being read", errno_mod.EIO
    if code in ("NotImplemented", "InvalidArgument", "InvalidRequest") and "hecksum" in str(e):
        return (
            f"the server refused the request ({e}); if it does not accept S3's additional "
            "checksums, pass storage_options={'checksum': None}"
        ), errno_mod.EINVAL
    return None
