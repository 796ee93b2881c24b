"""`mobile-moe sdk --out DIR`: the SDK folder an app links with pkg-config or CMake (mobile_moe.library.sdk)."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="the SDK folder to write (new, empty, or an earlier SDK folder)")
    parser.add_argument("--target", default="host", choices=("host", "linux-arm64"),
                        help="the machine it is for: this host (default), or a Linux ARM64 device (cross-built: "
                        "`make arm64` installs the toolchain)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from mobile_moe.library.sdk import write_sdk

    out = write_sdk(args.out, args.target)
    parts = "include/, lib/, java/, examples/" if (out / "java").is_dir() else "include/, lib/, examples/"
    print(f"wrote {out}: {parts} (pkg-config: PKG_CONFIG_PATH={out}/lib/pkgconfig); its README.md says how to ship it")
    return 0
