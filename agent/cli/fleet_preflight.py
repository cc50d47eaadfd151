"""Pre-flight for ``fleet rollout``: what can be checked from the operator's side before anything is sent.

The bundle is fetched (an http(s) URL, or a local archive or directory: ``--bundle-file`` names a local copy of
a bundle the boxes take from their own store) with the box's own fetch code, its ``manifest.json`` digest is
compared with ``--sha256``, and for every targeted box whose status names a known device kind and backend the
box's own artifact selection is run: a box the bundle has no artifact for refuses the rollout, naming it. A
bundle only the boxes can reach is said to be unchecked, never silently passed.
"""

import os
import shutil
import tempfile
import urllib.parse
from typing import TYPE_CHECKING, Callable, List, Optional

from agent.config.device_config import known_devices, load_device_config
from agent.config.schema import ConfigError
from agent.errors import CommandError
from agent.fleet.plan import RolloutError
from agent.fleet.status import BoxView

if TYPE_CHECKING:
    from agent.bundle.verify import Bundle

Check = Callable[[List[BoxView]], None]
URL_SCHEMES = ("http://", "https://")  # what the box's fetch downloads (agent.lifecycle.fetch.is_url)


def preflight(bundle: str, sha256: str, local: Optional[str], progress: Callable[[str], None],
              archive_sha256: Optional[str] = None) -> Optional[Check]:
    """Fetch and check the bundle now; the returned check runs against the boxes once they are gathered."""
    source = local or bundle
    if local is not None and not os.path.exists(local):  # named to be checked: an operator error, not a skip
        raise RolloutError("pre-flight: --bundle-file %s does not exist" % local)
    if not (source.startswith(URL_SCHEMES) or os.path.exists(source)):
        progress("pre-flight: %s is not reachable from here (a path in the boxes' bundle store?): not checked; "
                 "--bundle-file LOCAL checks a copy" % bundle)
        return None
    # The box's own bundle code (and with it numpy and OpenCV): loaded only for a bundle that can be checked.
    from agent.bundle.manifest import MANIFEST, BundleError, load_manifest
    from agent.bundle.verify import Bundle, sha256_file
    from agent.lifecycle.fetch import fetch_bundle
    from agent.lifecycle.fetch_policy import FetchPolicy, Refused

    staging = tempfile.mkdtemp(prefix="atlas-edge-preflight-")
    try:
        # The operator checks the URL it was given, on its own network (http, a private address, its port);
        # each box still applies its own fetch policy (fetch.ports included) to the deploy.
        url = urllib.parse.urlsplit(source)
        policy = FetchPolicy(schemes=("http", "https"), hosts=(url.hostname,) if url.hostname else (),
                             ports=(url.port,) if url.port else ())
        root = fetch_bundle(source, os.path.dirname(os.path.abspath(source)), staging, policy,
                            archive_sha256=archive_sha256)
        actual = sha256_file(os.path.join(root, MANIFEST)) if os.path.isfile(os.path.join(root, MANIFEST)) else None
        if actual != sha256:
            raise RolloutError("pre-flight: %s has manifest sha256 %s, not --sha256 %s" % (source, actual, sha256))
        manifest = load_manifest(root)
    except (BundleError, CommandError, ConfigError, OSError, Refused) as exc:  # CommandError: --archive-sha256
        raise RolloutError("pre-flight: %s: %s" % (source, " ".join(str(exc).split()))) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress("pre-flight: %s reachable, manifest sha256 matches (%s %s)" % (source, manifest.name,
                                                                          manifest.version))
    found = Bundle(root=source, manifest=manifest, manifest_sha256=sha256, signed=False)
    return lambda boxes: _fits(found, boxes, progress)


def _fits(bundle: "Bundle", boxes: List[BoxView], progress: Callable[[str], None]) -> None:
    """Each box's own artifact selection for its device kind and backend; RolloutError naming the misfits."""
    from agent.bundle.manifest import BundleError
    from agent.pipeline.artifacts import select_artifacts

    kinds = set(known_devices())
    misfits, unknown = [], []
    for box in boxes:
        if not box.online or box.kind not in kinds or not box.backend:
            unknown.append(box.device)
            continue
        try:
            select_artifacts(bundle, load_device_config(box.kind), box.backend)
        except (BundleError, ConfigError) as exc:
            misfits.append("%s (%s, %s): %s" % (box.device, box.kind, box.backend, " ".join(str(exc).split())[:200]))
    if unknown:
        progress("pre-flight: device kind not checked for %d box(es) (offline or kind unknown here): %s" % (
            len(unknown), ", ".join(unknown[:10])))
    if misfits:
        raise RolloutError("pre-flight: the bundle has nothing %d box(es) can run: %s" % (
            len(misfits), "; ".join(misfits[:10])))
