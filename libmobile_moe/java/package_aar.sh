#!/usr/bin/env bash
# Package the Java binding as an Android library (AAR): classes.jar (build_jar.sh), jni/ABI/ with libmobile_moe.so and libmobile_moe_jni.so, and AndroidManifest.xml. build_android.sh calls
# it after the NDK build; the tests call it on the host's libraries (the layout and the jar are the same).
#
#   java/package_aar.sh OUT.aar ABI LIBRARY_DIR
set -euo pipefail
OUT="$1" ABI="$2" LIBS="$3"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/aar/jni/$ABI"
"$HERE/build_jar.sh" "$WORK/aar/classes.jar"
for library in libmobile_moe.so libmobile_moe_jni.so; do
  cp -L "$LIBS/$library" "$WORK/aar/jni/$ABI/$library"
done
cat > "$WORK/aar/AndroidManifest.xml" <<'XML'
<?xml version="1.0" encoding="utf-8"?>
<manifest xmlns:android="http://schemas.android.com/apk/res/android" package="org.mobilemoe">
    <uses-sdk android:minSdkVersion="26" />
</manifest>
XML
(cd "$WORK/aar" && jar cfM "$WORK/out.aar" AndroidManifest.xml classes.jar jni)
mv "$WORK/out.aar" "$OUT"
