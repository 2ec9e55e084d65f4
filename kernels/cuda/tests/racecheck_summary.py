"""Groups compute-sanitizer racecheck reports by kernel, hazard kind and the two source sites.

Usage: python3 racecheck_summary.py racecheck.log [examples]
       compute-sanitizer --tool racecheck --print-limit 0 ... 2>&1 | python3 racecheck_summary.py - [examples]

For each (kernel, hazard, first site, second site) it prints the count and, for the first `examples`
groups (default 3), one report's lines as racecheck printed them (block and thread indices included),
so that a reader can tell whether the two accesses are in one block and which warpgroups they are in.
Then the number of reports read (beside how often "hazard detected" occurs in the log, a cross-check)
and the lines that are racecheck's summary or pytest's result. "-" reads the log from standard input,
so that every report of a run can be counted without storing the log (gigabytes with host backtraces).
"""
import collections
import re
import sys


def reports(lines):
    """Yields (header line, following detail lines) for each hazard report."""
    current = None
    for line in lines:
        text = line.rstrip("\n")
        if re.search(r"(Potential|Error:|Warning:).*hazard", text, re.IGNORECASE):
            if current:
                yield current
            current = (text, [])
        elif current is not None:
            if re.match(r"^=+\s*$", text) or not text.strip("= "):
                yield current
                current = None
            else:
                current[1].append(text)
    if current:
        yield current


def sites(detail):
    """The file:line sites and kernel names a report's detail lines name."""
    found = re.findall(r"([\w./-]+\.(?:cuh|cu|h):\d+)", " ".join(detail))
    # A kernel's name is an identifier followed by its template or parameter list (not a file name),
    # with the FormatId and int arguments of its template when it has them (the instance).
    kernels = []
    text = " ".join(detail)
    for match in re.finditer(r"(\w*(?:sparse_mla|combine|probe)\w*)([<(])", text):
        name = match.group(1)
        if match.group(2) == "<":
            arguments = text[match.end():match.end() + 200].split(">(")[0]
            numbers = re.findall(r"FormatId\)(\d+)|\(int\)(\d+)", arguments)
            if numbers:
                name += "<" + ",".join(a or b for a, b in numbers) + ">"
        kernels.append(name)
    return found, kernels


def main():
    path = sys.argv[1]
    examples = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    groups = collections.Counter()
    sample = {}
    tail = []  # racecheck's summary lines and pytest's result lines, as they come
    mentions = [0]  # occurrences of "hazard detected" anywhere in a line, against the reports parsed

    def lines(handle):
        for line in handle:
            mentions[0] += line.count("hazard detected")
            if "RACECHECK SUMMARY" in line or re.search(r"\d+ (passed|failed)", line):
                tail.append(line.strip("= \n"))
            yield line

    handle = sys.stdin if path == "-" else open(path, errors="replace")
    with handle:
        for header, detail in reports(lines(handle)):
            kind = re.search(r"(RAW|WAR|WAW)", header)
            found, kernels = sites(detail)
            key = (kernels[0][:60] if kernels else "?", kind.group(1) if kind else "?",
                   tuple(s.split("/")[-1] for s in found[:2]))
            groups[key] += 1
            sample.setdefault(key, [header] + detail[:8])
    if not groups:
        print("racecheck summary: no hazard reports")
    for n, (key, count) in enumerate(groups.most_common()):
        print(f"{count:8d}  {key[1]}  {key[0]}  {' / '.join(key[2])}")
        if n < examples:
            for line in sample[key]:
                print("          " + line.strip("= ")[:200])
    print(f"reports read: {sum(groups.values())} in {len(groups)} groups; "
          f"'hazard detected' seen {mentions[0]} times")
    for line in tail:
        print(line)


if __name__ == "__main__":
    main()
