#!/usr/bin/env bash
# demo.sh — set everything up (scripts/setup.sh), then run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo
heads demo
