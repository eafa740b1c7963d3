#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks that no header of include/moecomm includes a folder it is not allowed to.

Each folder is one scope; LAYERS says, bottom to top, which folders each may include (besides
itself and the base headers config.hpp, error.hpp, version.hpp). A header in a folder missing from
the table, or an include of a folder not in its row, fails the check and is named with its line.
docs/architecture.md shows the same table.

    include_layers.py INCLUDE_DIR       check the tree
    include_layers.py --self-test       check that the checker catches an upward include
"""
import os
import re
import sys

BASE = {"config.hpp", "error.hpp", "version.hpp"}
UMBRELLA = {"moecomm.hpp", "moecomm.cuh"}

LAYERS = [
    ("core",        []),
    ("simulation",  ["core"]),
    ("backend",     ["core", "simulation"]),
    ("comm",        ["core", "simulation", "backend"]),
    ("rows",        ["core"]),
    ("collectives", ["core", "comm", "rows"]),
    ("dispatch",    ["core", "comm", "rows", "collectives"]),
    ("planners",    ["core"]),
    ("models",      ["core", "simulation", "comm", "collectives", "planners"]),
    ("patterns",    ["core", "comm", "rows", "collectives", "dispatch", "planners", "models"]),
    ("torch",       ["core", "backend", "comm", "rows", "collectives", "dispatch", "patterns"]),
]

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]moecomm/([^>"]+)[>"]')


def scope(path):
    """The folder a header (path relative to include/moecomm) belongs to."""
    return path.split("/", 1)[0] if "/" in path else path


def violations(headers):
    """headers: {path relative to include/moecomm: [(line number, included path), ...]}."""
    allowed = {folder: set(below) for folder, below in LAYERS}
    found = []
    for header, includes in sorted(headers.items()):
        folder = scope(header)
        if folder in UMBRELLA:
            continue
        if folder in BASE:
            may = set()
        elif folder in allowed:
            may = allowed[folder] | {folder}
        else:
            found.append(f"{header}: folder '{folder}' is not in the layer table (tests/architecture/include_layers.py)")
            continue
        for line, target in includes:
            to = scope(target)
            if to in BASE:
                continue
            if to not in may:
                found.append(f"{header}:{line}: includes moecomm/{target}, but '{folder}' may include only "
                             f"{', '.join(sorted(may - {folder})) or 'the base headers'}")
    return found


def read_tree(include_dir):
    root = os.path.join(include_dir, "moecomm")
    headers = {}
    for directory, _, files in os.walk(root):
        for name in files:
            if not name.endswith((".hpp", ".cuh", ".h")):
                continue
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            with open(path, encoding="utf-8") as f:
                headers[rel] = [(n, m.group(1)) for n, text in enumerate(f, 1) if (m := INCLUDE.match(text))]
    return headers


def self_test():
    upward = {"rows/permute.hpp": [(7, "core/buffer.hpp"), (8, "dispatch/dispatcher.hpp")],
              "dispatch/dispatcher.hpp": [(9, "rows/permute.hpp")],
              "newfolder/thing.hpp": []}
    found = violations(upward)
    assert len(found) == 2, found
    assert found[0].startswith("newfolder/thing.hpp: folder 'newfolder'"), found
    assert "rows/permute.hpp:8: includes moecomm/dispatch/dispatcher.hpp" in found[1], found
    assert not violations({"rows/permute.hpp": [(7, "core/buffer.hpp"), (8, "config.hpp")]})
    print("include_layers self-test: an upward include and an unknown folder are caught")


def main(argv):
    if argv[1:] == ["--self-test"]:
        self_test()
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    headers = read_tree(argv[1])
    if not headers:
        print(f"no headers under {argv[1]}/moecomm", file=sys.stderr)
        return 1
    found = violations(headers)
    for v in found:
        print(v)
    print(f"{len(headers)} headers, {sum(len(i) for i in headers.values())} moecomm includes, "
          f"{len(found)} against the layers")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
