"""Print the requirements this Python environment does not satisfy, one per line (for `pip install`).

    python missing_requirements.py --of 'miles-lite[k8s]'                 # what miles-lite still needs
    python missing_requirements.py --check --of 'miles-lite[k8s]' 'nvidia-cudnn-cu12==9.12.*'
    python missing_requirements.py --absent --of transformer_engine       # only what is not installed at all

`--of DIST[EXTRA,...]` adds the requirements that the installed distribution DIST declares, its plain
ones and those of the extras named; other arguments are requirements themselves. Markers are evaluated
for this interpreter. `--check` prints nothing and exits 1 naming what is missing. `--absent` leaves out the
requirements whose distribution is installed at another version: the environment's version stays (for the
GPU image, the one SGLang runs on), and `pip check` reports the conflict.

The GPU image uses it to install TransformerEngine and miles-lite with `--no-deps` and then only what they
lack: a resolving install would resolve torch and the CUDA wheels again, and TransformerEngine's newer
cudnn-frontend would move the cutlass-dsl SGLang pins.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys

from packaging.requirements import Requirement


def declared(dist: str) -> list[Requirement]:
    """The requirements the installed distribution declares: `name` or `name[extra,...]`."""
    spec = Requirement(dist)
    out = []
    for text in md.requires(spec.name) or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in [*spec.extras, ""]):
            req.marker = None
            out.append(req)
    return out


def installed_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def unsatisfied(reqs: list[Requirement], absent_only: bool = False) -> list[Requirement]:
    """Those of `reqs` whose distribution is absent or (unless `absent_only`) at a version outside the specifier."""
    missing = []
    for req in reqs:
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = installed_version(req.name)
        if version is None or not (absent_only or req.specifier.contains(version, prereleases=True)):
            missing.append(req)
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if anything is missing")
    parser.add_argument("--absent", action="store_true",
                        help="only requirements whose distribution is not installed at all")
    parser.add_argument("--of", action="append", default=[], metavar="DIST[EXTRAS]",
                        help="the requirements an installed distribution declares (repeatable)")
    parser.add_argument("requirements", nargs="*", help="requirements, as pip takes them")
    args = parser.parse_args(argv)
    missing = unsatisfied([req for dist in args.of for req in declared(dist)]
                          + [Requirement(r) for r in args.requirements], args.absent)
    if not args.check:
        for req in missing:
            print(req)
        return 0
    if missing:
        print("not satisfied: " + ", ".join(f"{r} (installed: {installed_version(r.name) or 'none'})"
                                            for r in missing), file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
