#!/usr/bin/env bash
# The Java binding (org.mobilemoe) as a jar, compiled for Java 8: what Android's D8 takes, and any later JVM. The one
# build of it: the SDK's java/mobile-moe.jar (mobile_moe/library/sdk.py) and the AAR's classes.jar (package_aar.sh).
#
#   java/build_jar.sh OUT.jar
set -euo pipefail
OUT="$1"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CLASSES="$(mktemp -d)"
trap 'rm -rf "$CLASSES"' EXIT
javac --release 8 -nowarn -Xlint:-options -d "$CLASSES" "$HERE"/org/mobilemoe/*.java
jar cf "$OUT" -C "$CLASSES" .
