"""The launch and failure contracts every phalanx launcher keeps, run on
this one: every rank's value by global rank, a rank that raises and a rank
killed by SIGKILL reported as every launcher reports them, nothing left
running, nothing listening beyond loopback, and a flat script refused
clearly (this launcher runs functions only)."""

from phalanx.testing.suites import LauncherSuite


class TestPopenLauncher(LauncherSuite):
    launcher = "popen"  # or the qualified name, "phalanx-popen:popen"
