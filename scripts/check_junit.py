"""Exit non-zero unless every test a pytest JUnit report lists passed (none skipped, failed or in error).

`.ci/run` runs it on the VM scenarios' report: a green run must mean every scenario booted and passed.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET


def main(argv: list[str] | None = None) -> int:
    """Check one report; print one line."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("report")
    p.add_argument("--expect-at-least", type=int, default=1, help="fewer tests than this is a failure (a collection that lost some)")
    args = p.parse_args(argv)
    try:
        root = ET.parse(args.report).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"check_junit: cannot read {args.report}: {e}")
        return 1
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    print(f"check_junit: {passed} passed, {count['failures'] + count['errors']} failed, {count['skipped']} skipped")
    if passed != count["tests"] or count["tests"] < args.expect_at_least:
        print(f"check_junit: {count['tests']} collected, and every one of at least {args.expect_at_least} must pass")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
