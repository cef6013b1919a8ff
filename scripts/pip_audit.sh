#!/usr/bin/env bash
# Known vulnerabilities in .venv's installed packages (pip-audit, PyPI's advisory data; the project itself,
# installed editable, is skipped). Exit 1 when one is found; prints how many packages were looked up and which
# could not be (a lookup the service cannot answer is a warning, not a failure: DECISIONS D-177).
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p var
out=var/pip-audit.json
rm -f "$out"
.venv/bin/pip-audit --skip-editable --progress-spinner off --desc -f json -o "$out"
rc=$?
if [ ! -s "$out" ]; then
  echo "warning: pip-audit did not run to the end (exit $rc); no audit this time" >&2
  exit 0
fi
.venv/bin/python - "$out" "$rc" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
deps = report.get("dependencies", [])
skipped = [d for d in deps if d.get("skip_reason")]
vulnerable = [d for d in deps if d.get("vulns")]
print(f"pip-audit: {len(deps) - len(skipped)} packages looked up, {len(skipped)} skipped, "
      f"{len(vulnerable)} with known vulnerabilities")
for d in vulnerable:
    for v in d["vulns"]:
        print(f"  {d['name']} {d['version']}: {v['id']} (fixed in {', '.join(v.get('fix_versions') or []) or '-'})")
if skipped:
    reasons = sorted({d['skip_reason'].split(':')[0] for d in skipped})
    print(f"warning: not looked up: {', '.join(d['name'] for d in skipped[:12])}"
          f"{' ...' if len(skipped) > 12 else ''} ({'; '.join(reasons)})", file=sys.stderr)
sys.exit(1 if vulnerable else 0)
PY
