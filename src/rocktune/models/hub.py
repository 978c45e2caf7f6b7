"""Is a hub model id loadable here? Decided in seconds, before transformers' downloads retry for a minute.

Without network, ``from_pretrained("org/name")`` retries each file with growing back-off (a dozen "Retrying in 8s"
lines, about a minute) before it fails. One short probe of the hub endpoint, or ``HF_HUB_OFFLINE``, settles it
first: reachable -> load as usual; unreachable but cached -> load the cached copy in offline mode (no retries);
neither -> one paragraph saying how to give the model as a local directory.
"""

from __future__ import annotations

import functools
import os
import threading

from rocktune.errors import UserError

PROBE_TIMEOUT_S = 4.0  # the whole probe, DNS included: getaddrinfo ignores the HTTP client's own timeout


def check_hub_model(repo_id: str) -> str | None:
    """Raise ``UserError`` if ``repo_id`` cannot be loaded here; a note when it will load from the cache offline."""
    from huggingface_hub import constants

    cached = _cached(repo_id)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return None
        raise UserError(f"model.name_or_path={repo_id} is a hub id, HF_HUB_OFFLINE is set and the model is not "
                        f"in the local cache ({constants.HF_HUB_CACHE}). {_how_to_fix(repo_id)}")
    problem = probe(constants.ENDPOINT)
    if problem is None:
        return None
    if cached:
        # Transformers reads this per call: the cached files load at once instead of retrying each download.
        os.environ["HF_HUB_OFFLINE"] = "1"
        constants.HF_HUB_OFFLINE = True
        return f"the hub cannot be reached ({problem}); using the cached copy of {repo_id} offline"
    raise UserError(f"model.name_or_path={repo_id} is a hub id, but the hub ({constants.ENDPOINT}) cannot be reached "
                    f"from here ({problem}) and the model is not in the local cache ({constants.HF_HUB_CACHE}). "
                    f"{_how_to_fix(repo_id)}")


@functools.lru_cache(maxsize=8)
def probe(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when ``endpoint`` answers within ``timeout`` seconds, else what went wrong (asked once per process)."""
    outcome: list[str | None] = []

    def ask():
        try:
            from huggingface_hub.utils import get_session

            status = get_session().head(endpoint, timeout=timeout, follow_redirects=False).status_code
            outcome.append(None if status < 500 else f"HTTP {status}")
        except Exception as exc:  # noqa: BLE001 - the transport's exception classes differ between hub versions
            outcome.append(f"{type(exc).__name__}: {str(exc).strip()[:120]}")

    thread = threading.Thread(target=ask, daemon=True)  # a hung DNS lookup must not hold the process
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer within {timeout:.0f} s"


def _cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id at all: from_pretrained will say so
        return False


def _how_to_fix(repo_id: str) -> str:
    local = repo_id.rsplit("/", 1)[-1]
    return (f"Point model.name_or_path at a local model directory (config.json, the weights and the tokenizer "
            f"files), e.g. one downloaded on a machine with network by `hf download {repo_id} --local-dir {local}` "
            f"and copied here; or pre-download it into the cache while online and set HF_HUB_OFFLINE=1.")
