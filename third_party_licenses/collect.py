"""Regenerates this directory from the installed runtime dependencies' package metadata.

Usage (from the repository root, in the environment functrain runs in):
    python third_party_licenses/collect.py

For each runtime dependency, `<name>.txt` holds every License-File of its installed distribution
(dist-info `licenses/`), whole and in the order its METADATA lists them, each under a header naming
the file; README.md lists name, version and license type.
"""

import importlib.metadata as md
from pathlib import Path

DEPENDENCIES = [
    "torch",
    "optree",
    "einops",
    "tensorstore",
    "absl-py",
    "ml-collections",
    "numpy",
    "safetensors",
    "tokenizers",
]
HERE = Path(__file__).resolve().parent


def license_type(dist: md.Distribution) -> str:
    """SPDX expression, else the License field, else the OSI trove classifier."""
    meta = dist.metadata
    if meta.get("License-Expression"):
        return meta["License-Expression"]
    if meta.get("License") and len(meta["License"]) < 100:
        return meta["License"]
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    return ", ".join(classifiers) or "see file"


def license_files(dist: md.Distribution) -> list[str]:
    """The distribution's License-File entries (falling back to LICENSE-like files it records)."""
    names = dist.metadata.get_all("License-File") or []
    if names:
        return names
    return [str(f) for f in dist.files or [] if "LICEN" in f.name.upper() or "COPYING" in f.name.upper()]


def read_license(dist: md.Distribution, name: str) -> str:
    """Text of one license file, looked up under dist-info/licenses/ or as a recorded file."""
    for candidate in (f"licenses/{name}", name):
        text = dist.read_text(candidate)
        if text is not None:
            return text
    return Path(dist.locate_file(name)).read_text()


def _no_license_file(dist: md.Distribution) -> str:
    """A note for a distribution without license files, with the Apache-2.0 text it names (from safetensors')."""
    kind = license_type(dist)
    if "Apache" not in kind:
        raise SystemExit(f"{dist.metadata['Name']} ships no license file and is {kind!r}: add its text by hand")
    apache = read_license(md.distribution("safetensors"), license_files(md.distribution("safetensors"))[0])
    return (
        f"{'=' * 78}\n{dist.metadata['Name']} {dist.version}: no license file in the wheel; its metadata names "
        f"{kind} (Apache License 2.0), whose text follows\n{'=' * 78}\n{apache.rstrip()}\n"
    )


def main() -> None:
    rows = []
    for dep in DEPENDENCIES:
        dist = md.distribution(dep)
        names = license_files(dist)
        parts = []
        for name in names:
            header = f"{'=' * 78}\n{dist.metadata['Name']} {dist.version}: {name}\n{'=' * 78}\n"
            parts.append(header + read_license(dist, name).rstrip() + "\n")
        if not parts:  # some wheels (tokenizers) ship no license file: say so, and give the named license's text
            parts.append(_no_license_file(dist))
        (HERE / f"{dep}.txt").write_text("\n".join(parts))
        rows.append((dep, dist.version, license_type(dist), len(names)))
    lines = [
        "# Third-party licenses",
        "",
        "Licenses of functrain's runtime dependencies, copied whole from the installed packages'",
        "metadata (`<name>.dist-info/licenses/`) by `collect.py`; rerun it after upgrading a dependency.",
        "Each `<name>.txt` holds all license files of that distribution (bundled third-party licenses",
        "included), each under a header naming it.",
        "",
        "| Package | Version | License | Files |",
        "|---|---|---|---|",
    ]
    lines += [f"| {n} | {v} | {t} | `{n}.txt` ({k} license file{'s' * (k != 1)}) |" for n, v, t, k in rows]
    (HERE / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
