"""Discovery through real (throw-away) distributions, and every broken plugin."""

from __future__ import annotations

import pytest

import registry_plugin_sources as src
from phalanx_core import PluginError, UnavailableError, UnknownNameError
from phalanx_core.specs import CollectiveSpec, Kind


@pytest.fixture
def only(monkeypatch):
    """Load only the named plugins (so the installed phalanx-torch stays out)."""

    def allow(*names: str) -> None:
        monkeypatch.setenv("PHALANX_PLUGINS", ",".join(names))
        monkeypatch.delenv("PHALANX_DISABLE_PLUGINS", raising=False)

    return allow


def install_good(phalanx_distribution, dist="good-plugin", pkg="good_plugin", ep="good"):
    phalanx_distribution(
        dist,
        version="1.2.3",
        entry_points={ep: pkg},
        modules={pkg: src.GOOD.format(pkg=pkg), f"{pkg}.impl": src.ECHO_IMPL},
    )


def install_broken(phalanx_distribution, dist: str, source: str, pkg: str | None = None) -> None:
    pkg = pkg or dist.replace("-", "_")
    phalanx_distribution(dist, entry_points={dist: pkg}, modules={pkg: source.format(pkg=pkg)})


def test_plugin_parts_are_found_with_their_distribution(phalanx_distribution, phalanx_registry, only):
    install_good(phalanx_distribution)
    only("good")
    registry = phalanx_registry()
    entry = registry.get("collective", "echo")
    assert entry.provider.plugin == "good"
    assert entry.provider.distribution == "good-plugin"
    assert entry.provider.version == "1.2.3"
    assert entry.qualified_name == "good-plugin:echo"
    assert registry.get("collective", "good-plugin:echo") is entry
    assert registry.get("collective", "Good_Plugin:echo") is entry  # normalised distribution
    [record] = [p for p in registry.plugins if p.status == "loaded"]
    assert record.status == "loaded"
    assert record.hooks == ["phalanx_collectives", "phalanx_strategies"]
    assert entry.load().__name__ == "Echo"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (src.RAISES_ON_IMPORT, "RuntimeError: this plugin is broken on purpose"),
        (src.SYNTAX_ERROR, "SyntaxError"),
        (src.HOOK_RAISES, "hook phalanx_collectives raised ValueError: hook failed on purpose"),
        (src.WRONG_TYPE, "returned str; it must return an iterable of CollectiveSpec"),
        (src.WRONG_SPEC_KIND, "every item must be a CollectiveSpec"),
        (src.MISSPELT, "'phalanx_colectives' (did you mean 'phalanx_collectives'?)"),
    ],
    ids=["import-raises", "syntax-error", "hook-raises", "wrong-type", "wrong-spec-kind", "misspelt-hook"],
)
def test_a_broken_plugin_is_recorded_and_the_others_load(
    phalanx_distribution, phalanx_registry, only, source, expected
):
    install_good(phalanx_distribution)
    install_broken(phalanx_distribution, "broken-plugin", source)
    only("good", "broken-plugin")
    registry = phalanx_registry()
    assert registry.get("collective", "echo").provider.distribution == "good-plugin"
    [failed] = registry.failures
    assert failed.provider.distribution == "broken-plugin"
    assert failed.provider.version == "0.1.0"
    assert expected in failed.error
    if source is not src.WRONG_TYPE and source is not src.WRONG_SPEC_KIND:
        assert failed.traceback
    # The failure shows in every unknown-name error: the name may live there.
    with pytest.raises(UnknownNameError) as info:
        registry.get("collective", "missing")
    message = str(info.value)
    assert "unknown collective 'missing'" in message
    assert "echo" in message  # what exists
    assert "'broken-plugin' (broken-plugin 0.1.0)" in message  # who failed
    assert expected in message


def test_misspelt_hook_is_unregistered(phalanx_distribution, phalanx_registry, only):
    install_broken(phalanx_distribution, "typo-plugin", src.MISSPELT)
    only("typo-plugin")
    registry = phalanx_registry()
    assert registry.names("collective") == []
    assert "the hooks are phalanx_accelerators" in registry.failures[0].error


def test_two_plugins_with_one_name_is_an_error_at_use_naming_both(
    phalanx_distribution, phalanx_registry, only
):
    install_good(phalanx_distribution, dist="first-plugin", pkg="first_plugin", ep="first")
    install_good(phalanx_distribution, dist="second-plugin", pkg="second_plugin", ep="second")
    only("first", "second")
    registry = phalanx_registry()  # loading is lenient
    with pytest.raises(PluginError) as info:
        registry.get("collective", "echo")
    message = str(info.value)
    assert "'first' (first-plugin 1.2.3) as 'first-plugin:echo'" in message
    assert "'second' (second-plugin 1.2.3) as 'second-plugin:echo'" in message
    assert "qualified name" in message
    assert registry.get("collective", "second-plugin:echo").provider.plugin == "second"


def test_same_entry_point_name_in_two_distributions_both_load(phalanx_distribution, phalanx_registry, only):
    install_good(phalanx_distribution, dist="first-plugin", pkg="first_plugin", ep="same")
    install_good(phalanx_distribution, dist="second-plugin", pkg="second_plugin", ep="same")
    only("same")
    registry = phalanx_registry()
    assert [p.status for p in registry.plugins if p.provider.plugin == "same"] == ["loaded", "loaded"]
    assert registry.get("strategy", "first_plugin_strategy")
    assert registry.get("strategy", "second_plugin_strategy")


def test_bad_targets_fail_when_used_and_name_the_distribution(phalanx_distribution, phalanx_registry, only):
    install_broken(phalanx_distribution, "targets-plugin", src.BAD_TARGET)
    only("targets-plugin")
    registry = phalanx_registry()
    assert registry.failures == []  # nothing is imported until used
    with pytest.raises(PluginError, match=r"cannot be imported .*ModuleNotFoundError") as info:
        registry.get("collective", "nomodule").load()
    assert "'targets-plugin' (targets-plugin 0.1.0)" in str(info.value)
    assert "Fix or uninstall targets-plugin" in str(info.value)
    with pytest.raises(PluginError, match=r"does not exist \(module 'targets_plugin' has no 'Missing'\)"):
        registry.get("collective", "noattr").load()
    with pytest.raises(
        UnavailableError, match=r"needs no_such_backend_pkg.*run: pip install no-such-backend"
    ):
        registry.get("collective", "needsit").load()


def test_listing_imports_no_plugin_target(phalanx_distribution, phalanx_registry, only):
    import sys

    install_good(phalanx_distribution)
    only("good")
    registry = phalanx_registry()
    assert [e.name for e in registry.entries(Kind.COLLECTIVE)] == ["echo"]
    assert "good_plugin.impl" not in sys.modules


def test_plugins_passed_as_objects_and_run_time_registration(phalanx_registry, monkeypatch):
    from phalanx_core import MisconfigurationError, hookimpl

    class Plugin:
        @hookimpl
        def phalanx_collectives(self):
            return [CollectiveSpec(name="objcoll", target="x.y:Z")]

    registry = phalanx_registry(plugins=[Plugin()], autoload=False)
    entry = registry.get("collective", "objcoll")
    assert entry.provider.plugin == "Plugin"
    assert entry.provider.distribution is None
    spec = CollectiveSpec(name="objcoll", target="a.b:C")
    with pytest.raises(MisconfigurationError, match=r"already exists, given by .Plugin.*replace=True"):
        registry.register(spec)
    mine = registry.register(spec, replace=True)
    assert registry.get("collective", "objcoll") is mine
    with pytest.raises(MisconfigurationError, match="give a spec of one kind"):
        registry.register("objcoll")  # type: ignore[arg-type]


def test_a_plugin_object_that_fails_raises_at_once(phalanx_registry):
    from phalanx_core import hookimpl

    class Broken:
        @hookimpl
        def phalanx_strategies(self):
            return 42

    with pytest.raises(PluginError, match="returned int"):
        phalanx_registry(plugins=[Broken()], autoload=False)


def test_debug_traces_hook_calls(phalanx_distribution, phalanx_registry, only, monkeypatch, capsys):
    install_good(phalanx_distribution)
    only("good")
    monkeypatch.setenv("PHALANX_DEBUG", "1")
    phalanx_registry()
    err = capsys.readouterr().err
    assert "loading 'good' (good-plugin 1.2.3): good_plugin" in err
    assert "phalanx_collectives of 'good' (good-plugin 1.2.3) returned [CollectiveSpec(name='echo'" in err


# PHALANX_PLUGINS / PHALANX_DISABLE_PLUGINS as a table of values.
# Two plugins are installed: entry point "good" of "good-plugin", and entry
# point "other" of "Other.Plugin" (a name that normalises to other-plugin).
@pytest.mark.parametrize(
    ("allow", "deny", "loaded"),
    [
        (None, None, {"good", "other"}),
        ("", None, set()),
        ("good", None, {"good"}),
        ("good-plugin", None, {"good"}),
        ("other-plugin", None, {"other"}),
        ("OTHER_plugin", None, {"other"}),  # odd case and separators
        (" good , other ", None, {"good", "other"}),
        ("nothing-by-this-name", None, set()),
        (None, "good", {"other"}),
        (None, "Other.Plugin", {"good"}),
        (None, "", {"good", "other"}),
        (None, "nothing-by-this-name", {"good", "other"}),
        ("good,other", "other", {"good"}),
    ],
)
def test_plugin_environment_variables(
    phalanx_distribution, phalanx_registry, monkeypatch, allow, deny, loaded
):
    install_good(phalanx_distribution)
    install_good(phalanx_distribution, dist="Other.Plugin", pkg="other_plugin", ep="other")
    for var, value in (("PHALANX_PLUGINS", allow), ("PHALANX_DISABLE_PLUGINS", deny)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    registry = phalanx_registry()
    ours = {p.provider.plugin: p for p in registry.plugins if p.provider.plugin in ("good", "other")}
    assert {name for name, p in ours.items() if p.status == "loaded"} == loaded
    for name, record in ours.items():
        if name not in loaded:
            assert record.status == "disabled"
            assert "PHALANX_" in record.error


# -- reading entry points without importlib.metadata (issue 31, item 9) -------


def both_readers(group: str):
    from phalanx._discovery import _from_importlib_metadata, entry_points

    return entry_points(group), _from_importlib_metadata(group)


@pytest.mark.parametrize("group", ["phalanx.plugins", "console_scripts", "pytest11"])
def test_the_folders_give_what_importlib_metadata_gives(group):
    from phalanx._discovery import _read_folders

    assert _read_folders(group) is not None  # this environment is read from its folders
    ours, theirs = both_readers(group)
    assert ours == theirs and ours


def test_the_first_distribution_on_the_path_wins_and_the_text_is_read_alike(tmp_path, monkeypatch):
    from phalanx_core.testing._distributions import write_distribution

    write_distribution(
        tmp_path / "a", "Twice.Plugin", version="2.0", entry_points={"twice": "twice_a:plugin"}
    )
    write_distribution(tmp_path / "b", "twice-plugin", version="1.0", entry_points={"twice": "twice_b"})
    info = tmp_path / "c" / "old_style-0.3-py3.11.egg-info"
    info.mkdir(parents=True)
    (info / "PKG-INFO").write_text("Metadata-Version: 1.1\nName: old-style\nVersion: 0.3\n\nName: body\n")
    (info / "entry_points.txt").write_text(
        "# a comment\n[other]\nx = nope\n\n[phalanx.plugins]\n  old = old_style.plugin : thing [extra]\n"
        "spaced=old_style.spaced\n"
    )
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "not_a_folder.egg-info").write_text("Name: x\n")  # distutils' single-file form
    for folder in "dcba":
        monkeypatch.syspath_prepend(str(tmp_path / folder))
    ours, theirs = both_readers("phalanx.plugins")
    assert ours == theirs
    mine = [ep for ep in ours if ep.name in ("twice", "old", "spaced")]
    assert [(ep.name, ep.value, ep.distribution, ep.version) for ep in mine] == [
        ("twice", "twice_a:plugin", "Twice.Plugin", "2.0"),
        ("old", "old_style.plugin : thing [extra]", "old-style", "0.3"),
        ("spaced", "old_style.spaced", "old-style", "0.3"),
    ]


def test_an_entry_point_loads_its_module_and_attribute(tmp_path, monkeypatch):
    from phalanx._discovery import EntryPoint

    (tmp_path / "ep_target.py").write_text("class Outer:\n    class Inner:\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = EntryPoint("x", "ep_target : Outer.Inner [extra]").load()
    assert loaded.__qualname__ == "Outer.Inner"
    assert EntryPoint("x", "ep_target").load().__name__ == "ep_target"
    with pytest.raises(ValueError, match="'not a target!' is not 'module' or 'module:attr'"):
        EntryPoint("x", "not a target!").load()


def test_a_zip_on_the_path_is_read_by_importlib_metadata(tmp_path, monkeypatch):
    import zipfile

    from phalanx._discovery import _read_folders

    archive = tmp_path / "zipped.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr(
            "zipped_plugin-0.4.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: zipped-plugin\nVersion: 0.4\n",
        )
        z.writestr(
            "zipped_plugin-0.4.dist-info/entry_points.txt", "[phalanx.plugins]\nzipped = zipped_plugin\n"
        )
    monkeypatch.syspath_prepend(str(archive))
    assert _read_folders("phalanx.plugins") is None
    ours, theirs = both_readers("phalanx.plugins")
    assert ours == theirs
    assert ("zipped", "zipped-plugin", "0.4") in [(ep.name, ep.distribution, ep.version) for ep in ours]


def test_a_finder_of_another_package_is_asked_through_importlib_metadata(monkeypatch):
    import sys

    from phalanx._discovery import _read_folders

    class Finder:
        def find_spec(self, *args):
            return None

        def find_distributions(self, context=None):
            return iter(())

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    assert _read_folders("phalanx.plugins") is None
    ours, theirs = both_readers("phalanx.plugins")
    assert ours == theirs


VERSIONED = """
from phalanx_core import CollectiveSpec, StrategySpec, hookimpl

@hookimpl
def phalanx_collectives():
    return [CollectiveSpec(name="pinned", target="{pkg}:Missing", needs=("oldlib>=2.9,<4",),
                           install="pip install oldlib")]

@hookimpl
def phalanx_strategies():
    return [StrategySpec(name="pinned_strategy", target="{pkg}:Missing", collective="pinned",
                         needs=("oldlib>=2.9,<4",))]
"""


@pytest.mark.parametrize(
    ("installed", "said"),
    [
        ("2.5.1", "oldlib>=2.9,<4 (oldlib 2.5.1 is installed); run: pip install 'oldlib>=2.9,<4'"),
        ("4.0.0", "oldlib>=2.9,<4 (oldlib 4.0.0 is installed); run: pip install 'oldlib>=2.9,<4'"),
        ("2.9.0", None),
        ("3.1.0+local", None),
    ],
)
def test_a_backend_outside_the_parts_range_is_refused_naming_the_range(
    phalanx_distribution, phalanx_registry, only, installed, said
):
    """A backend's version is read from its installed distribution (a real
    dist-info folder here), never by importing it."""
    import io
    import json
    import sys

    import phalanx.cli

    phalanx_distribution(
        "oldlib", version=installed, modules={"oldlib": "raise ImportError('never imported')"}
    )
    install_broken(phalanx_distribution, "pinned-plugin", VERSIONED)
    only("pinned-plugin")
    registry = phalanx_registry()
    entry = registry.get("collective", "pinned")
    out = io.StringIO()
    assert phalanx.cli.main(["list", "--json"], out) == 0
    [backend] = json.loads(out.getvalue())["backends"]
    assert backend["installed"] == installed
    assert backend["supported"] is (said is None)
    assert backend["ranges"] == [{"distribution": "pinned-plugin 0.1.0", "versions": ">=2.9,<4"}]
    out = io.StringIO()
    assert phalanx.cli.main(["list"], out) == 0
    verdict = "in the range of" if said is None else "NOT in the range of"
    assert f"oldlib {installed}: {verdict} pinned-plugin 0.1.0 (>=2.9,<4)" in out.getvalue()
    if said is None:
        assert entry.missing() == []
        with pytest.raises(PluginError, match="has no 'Missing'"):  # past the check, to the target
            entry.load()
    else:
        assert "no: needs oldlib>=2.9,<4" in out.getvalue()
        with pytest.raises(UnavailableError) as info:
            entry.load()
        assert (
            str(info.value)
            == f"collective 'pinned' from 'pinned-plugin' (pinned-plugin 0.1.0) supports {said}"
        )
    assert "oldlib" not in sys.modules
