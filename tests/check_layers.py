#!/usr/bin/env python3
"""Checks that no file of src/ includes a header of a layer its own does not build on.

The layers and what each builds on are defined once, in src/meson.build (`layer_below`),
which passes them here as arguments, one per layer, bottom up:

    check_layers.py ROOT policy= nft=policy dns=policy audit=dns control=audit ...

A file in src/LAYER/ may include headers of LAYER itself and of every layer LAYER builds
on, directly or through another layer; the headers of include/egressd/ belong to the
lowest layer (the first argument). Every directory of src/ must be a layer, and every
`#include "..."` must name a header of a layer. Each violation is printed as
`FILE:LINE: ...` naming the include and the layers the file may use; the exit status is 1
if there is any. `check_layers.py --self-test` checks the checker on a tree of its own.
"""

import os
import re
import sys
import tempfile

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
SOURCE_SUFFIXES = ('.h', '.hh', '.hpp', '.cc', '.cpp', '.inc', '.inl')


def parse_layers(specs):
    """Returns (order, below) from arguments such as 'audit=dns,policy'."""
    order, below = [], {}
    for spec in specs:
        name, sep, deps = spec.partition('=')
        if not sep or not name:
            raise ValueError(f'bad layer argument {spec!r} (want NAME=BELOW,...)')
        if name in below:
            raise ValueError(f'layer {name} given twice')
        deps = [d for d in deps.split(',') if d]
        for d in deps:
            if d not in below:
                raise ValueError(f'layer {name} builds on {d}, which is not a layer given before it')
        order.append(name)
        below[name] = deps
    if not order:
        raise ValueError('no layers given')
    return order, below


def closure(below):
    """Every layer each layer may use: itself and everything under it."""
    allowed = {}
    for name, deps in below.items():  # bottom up, so every dep is done already
        allowed[name] = {name}.union(*(allowed[d] for d in deps))
    return allowed


def layer_of(root, including_dir, header, order):
    """The layer a quoted include names, or None."""
    first = header.split('/', 1)[0]
    if first == 'egressd' and os.path.isfile(os.path.join(root, 'include', header)):
        return order[0]
    if '/' in header and first in order:
        return first
    # A header next to the including file, e.g. "nl_handles.h" within src/nft/.
    if os.path.isfile(os.path.join(including_dir, header)):
        rel = os.path.relpath(os.path.join(including_dir, header), os.path.join(root, 'src'))
        top = rel.split(os.sep, 1)[0]
        if top in order:
            return top
    return None


def check(root, order, below):
    """Returns the violations as 'file:line: text' strings, sorted."""
    allowed = closure(below)
    problems = []
    src = os.path.join(root, 'src')
    files = []  # (layer, path)
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if not os.path.isdir(path):
            continue
        if entry not in below:
            problems.append(f'src/{entry}/: a directory that is no layer; add it to layer_below '
                            'in src/meson.build')
            continue
        for dirpath, _, names in os.walk(path):
            files += [(entry, os.path.join(dirpath, n)) for n in sorted(names)]
    inc = os.path.join(root, 'include', 'egressd')
    if os.path.isdir(inc):
        files += [(order[0], os.path.join(inc, n)) for n in sorted(os.listdir(inc))]
    for layer, path in files:
        if not path.endswith(SOURCE_SUFFIXES):
            continue
        rel = os.path.relpath(path, root)
        with open(path, encoding='utf-8', errors='replace') as f:
            for lineno, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                header = m.group(1)
                target = layer_of(root, os.path.dirname(path), header, order)
                if target is None:
                    problems.append(f'{rel}:{lineno}: #include "{header}" names no header of '
                                    'a layer (want LAYER/file.h or egressd/file.h)')
                elif target not in allowed[layer]:
                    may = ', '.join(n for n in order if n in allowed[layer])
                    problems.append(f'{rel}:{lineno}: #include "{header}": layer {layer} does '
                                    f'not build on layer {target}; it may include only {may} '
                                    '(layer_below in src/meson.build)')
    return problems


def self_test():
    """The checker finds an upward include, an unknown directory and an unknown header,
    and passes a tree without them."""
    order, below = parse_layers(['policy=', 'nft=policy', 'dns=policy', 'audit=dns',
                                 'control=audit'])
    with tempfile.TemporaryDirectory() as root:
        def write(rel, text):
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, 'w', encoding='utf-8') as f:
                f.write(text)
        write('include/egressd/result.h', '#pragma once\n')
        write('src/policy/entry.cc', '#include "egressd/result.h"\n#include <vector>\n')
        write('src/nft/nl.h', '#pragma once\n')
        write('src/nft/model.cc', '#include "nl.h"\n#include "nft/nl.h"\n')
        write('src/dns/message.h', '#pragma once\n')
        write('src/audit/explain.cc', '#include "dns/message.h"\n#include "egressd/result.h"\n')
        write('src/control/protocol.h', '#include "audit/explain.h"\n#include "dns/message.h"\n')
        got = check(root, order, below)
        if got:
            return [f'a clean tree was reported: {got}']
        write('src/dns/matcher.cc', '// a comment\n  #  include "control/protocol.h"\n')
        write('src/dns/proxy.cc', '#include "nft/nl.h"\n')
        write('src/policy/ip.cc', '\n#include "helper.h"\n')
        write('src/extra/x.cc', '\n')
        got = check(root, order, below)
        want = [
            'src/dns/matcher.cc:2: #include "control/protocol.h": layer dns does not build on '
            'layer control; it may include only policy, dns (layer_below in src/meson.build)',
            'src/dns/proxy.cc:1: #include "nft/nl.h": layer dns does not build on layer nft; '
            'it may include only policy, dns (layer_below in src/meson.build)',
            'src/extra/: a directory that is no layer; add it to layer_below in src/meson.build',
            'src/policy/ip.cc:2: #include "helper.h" names no header of a layer '
            '(want LAYER/file.h or egressd/file.h)',
        ]
        if sorted(got) != sorted(want):
            return ['want:'] + want + ['got:'] + got
    for bad in (['a'], ['audit=dns', 'dns='], ['policy=', 'policy=']):
        try:
            parse_layers(bad)
            return [f'layer arguments {bad} were accepted']
        except ValueError:
            pass
    return []


def main(argv):
    if argv[1:] == ['--self-test']:
        problems = self_test()
        for p in problems:
            print(p)
        print('check_layers self-test:', 'FAILED' if problems else 'ok')
        return 1 if problems else 0
    if len(argv) < 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    root = argv[1]
    try:
        order, below = parse_layers(argv[2:])
    except ValueError as e:
        print(f'check_layers: {e}', file=sys.stderr)
        return 2
    problems = check(root, order, below)
    for p in problems:
        print(p)
    chain = '; '.join(f'{n} on {",".join(below[n]) or "nothing"}' for n in order)
    if problems:
        print(f'check_layers: {len(problems)} include(s) break the layers ({chain})')
        return 1
    print(f'check_layers: every include of src/ and include/egressd/ keeps the layers ({chain})')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
