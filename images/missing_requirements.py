"""Print the requirements this Python environment does not satisfy, one per line (for `pip install`).

    python missing_requirements.py --of 'miles-lite[k8s]'                 # what miles-lite still needs
    python missing_requirements.py --check --of 'miles-lite[k8s]' 'nvidia-cudnn-cu12==9.12.*'

`--of DIST[EXTRA,...]` adds the requirements that the installed distribution DIST declares, its plain
ones and those of the extras named; other arguments are requirements themselves. Markers are evaluated
for this interpreter. `--check` prints nothing and exits 1 naming what is missing.

The GPU image uses it to install miles-lite with `--no-deps` and then only what it lacks: a resolving
install would resolve torch again and put back the cuDNN that torch pins over the newer one
TransformerEngine was built with.
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


def unsatisfied(reqs: list[Requirement]) -> list[Requirement]:
    """Those of `reqs` whose distribution is absent or at a version outside the specifier."""
    missing = []
    for req in reqs:
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = installed_version(req.name)
        if version is None or not req.specifier.contains(version, prereleases=True):
            missing.append(req)
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if anything is missing")
    parser.add_argument("--of", action="append", default=[], metavar="DIST[EXTRAS]",
                        help="the requirements an installed distribution declares (repeatable)")
    parser.add_argument("requirements", nargs="*", help="requirements, as pip takes them")
    args = parser.parse_args(argv)
    missing = unsatisfied([req for dist in args.of for req in declared(dist)]
                          + [Requirement(r) for r in args.requirements])
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
