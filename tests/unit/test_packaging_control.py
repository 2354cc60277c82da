"""packaging/debian against the tree: what each package ships, what its code imports, what it
depends on, and which package installs which unit and which launcher. No build."""

from __future__ import annotations

import ast
import configparser
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DEBIAN = REPO / "packaging" / "debian"
PYTHON_PACKAGES = ("dsv41-agent", "dsv41-coordinator", "dsv41-sim")
# Top-level import name -> the Debian package that provides it on the host.
DISTRIBUTION_MODULES = {
    "grpc": "python3-grpcio", "google": "python3-protobuf", "pydbus": "python3-pydbus", "gi": "python3-gi",
    "psutil": "python3-psutil", "pyroute2": "python3-pyroute2", "systemd": "python3-systemd",
    "cryptography": "python3-cryptography", "prometheus_client": "python3-prometheus-client",
}
# What the launchers put on sys.path besides the package's own directory: the directory of
# another package this one depends on.
EXTRA_PATHS = {"dsv41-sim": {"/usr/share/dsv41/rank": "dsv41-adapter"}}


def paragraphs() -> dict[str, dict[str, str]]:
    """debian/control as {Package or "source": {field: value}} (continuation lines joined)."""
    out = {}
    for block in re.split(r"\n\s*\n", (DEBIAN / "control").read_text().strip()):
        fields: dict[str, str] = {}
        key = None
        for line in block.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line.strip()
            else:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        out[fields.get("Package", "source")] = fields
    return out


def relations(field: str) -> dict[str, str]:
    """A Depends-like field as {name: version constraint or ""}; alternatives are kept whole."""
    out = {}
    for item in filter(None, (x.strip() for x in field.replace("\n", " ").split(","))):
        name, _, rest = item.partition(" ")
        out[name] = rest.strip()
    return out


def install_entries(package: str) -> list[tuple[str, str]]:
    path = DEBIAN / f"{package}.install"
    return [tuple(line.split()) for line in path.read_text().splitlines() if line.strip()]  # type: ignore[misc]


def shipped_files(package: str) -> dict[str, Path]:
    """{installed path: source file} of everything dh_install copies for the package."""
    out = {}
    for src, dest in install_entries(package):
        if "*" in src:  # a glob: dh_install copies each match into dest
            out.update({f"/{dest}/{f.name}": f for f in sorted(REPO.glob(src)) if f.is_file()})
            continue
        source = REPO / src
        if source.is_dir():
            for f in sorted(source.rglob("*")):
                if f.is_file() and "__pycache__" not in f.parts:
                    out[f"/{dest}/{f.relative_to(source.parent)}"] = f
        else:
            out[f"/{dest}/{source.name}"] = source
    return out


def private_dir(package: str) -> str:
    return f"/usr/share/{package}"


def module_paths(module: str, root: str) -> tuple[str, str]:
    base = f"{root}/{module.replace('.', '/')}"
    return f"{base}.py", f"{base}/__init__.py"


def imports(path: Path, module: str) -> list[tuple[str, tuple[str, ...], int]]:
    """(absolute module, imported names, line) of every import in the file, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            out.append((name, tuple(a.name for a in node.names), node.lineno))
    return out


def test_four_architecture_all_packages_from_one_native_source() -> None:
    control = paragraphs()
    assert set(control) == {"source", "dsv41-agent", "dsv41-coordinator", "dsv41-adapter", "dsv41-sim"}
    assert all(fields["Architecture"] == "all" for name, fields in control.items() if name != "source")
    assert "debhelper-compat (= 13)" in control["source"]["Build-Depends"]
    assert "dh-sequence-python3" in control["source"]["Build-Depends"]
    assert (DEBIAN / "source" / "format").read_text().strip() == "3.0 (native)"


def test_required_distribution_dependencies() -> None:
    control = paragraphs()
    agent = relations(control["dsv41-agent"]["Depends"])
    coordinator = relations(control["dsv41-coordinator"]["Depends"])
    for name in ("python3-pydbus", "python3-gi", "python3-psutil", "python3-pyroute2", "python3-grpcio",
                 "python3-protobuf", "python3-systemd"):
        assert name in agent, name
    for name in ("python3-grpcio", "python3-protobuf", "python3-cryptography", "python3-systemd",
                 "python3-prometheus-client"):
        assert name in coordinator, name
    # Debian 12 has 0.16 (Ubuntu 24.04 0.19): the collector keeps to the API both have.
    assert coordinator["python3-prometheus-client"] == "(>= 0.16)"
    # The agent writes the pack format the installed adapter reads: always the same build.
    assert agent["dsv41-adapter"] == "(= ${binary:Version})"
    # What the coordinator shares with the rank is in its own copy of dsv41/: it needs no adapter.
    assert "dsv41-adapter" not in coordinator
    # The adapter's files run in the rank's own Python, never the host's.
    adapter = relations(control["dsv41-adapter"]["Depends"])
    assert not [name for name in adapter if name.startswith("python3") or "python3:" in name], adapter
    for package in PYTHON_PACKAGES:
        assert "${python3:Depends}" in relations(control[package]["Depends"]), package


def test_nothing_is_installed_into_dist_packages() -> None:
    for package in ("dsv41-agent", "dsv41-coordinator", "dsv41-adapter", "dsv41-sim"):
        for _, dest in install_entries(package):
            assert "dist-packages" not in dest and "site-packages" not in dest, (package, dest)


@pytest.mark.parametrize("package", PYTHON_PACKAGES)
def test_every_import_of_shipped_code_is_shipped_or_a_dependency(package: str) -> None:
    """An import that works from a source checkout but not from the installed package fails here:
    a module of the tree not installed with the package, or a distribution module not in Depends."""
    control = paragraphs()
    depends = relations(control[package]["Depends"])
    root = private_dir(package)
    files = shipped_files(package)
    extra = {p: shipped_files(dep) for p, dep in EXTRA_PATHS.get(package, {}).items()}
    for dep in EXTRA_PATHS.get(package, {}).values():
        assert dep in depends, f"{package} puts {dep}'s directory on sys.path but does not depend on it"
    problems = []
    for installed, source in files.items():
        if not installed.startswith(root + "/") or source.suffix != ".py":
            continue
        module = installed[len(root) + 1:-3].replace("/", ".").removesuffix(".__init__")
        for name, names, line in imports(source, module):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names:
                continue
            if top in DISTRIBUTION_MODULES:
                if DISTRIBUTION_MODULES[top] not in depends:
                    problems.append(f"{source.relative_to(REPO)}:{line}: imports {name}, but {package} "
                                    f"does not depend on {DISTRIBUTION_MODULES[top]}")
                continue
            candidates = [(root, files)] + [(p, f) for p, f in extra.items()]
            found = [(r, f) for r, f in candidates if any(m in f for m in module_paths(name, r))]
            if not found:
                problems.append(f"{source.relative_to(REPO)}:{line}: imports {name}, which {package} does not "
                                f"ship (packaging/debian/{package}.install) and no dependency provides")
                continue
            r, f = found[0]
            for sub in names:  # `from pkg import module` needs that module shipped too
                tree_module = REPO / name.replace(".", "/") / f"{sub}.py"
                if tree_module.exists() and f"{r}/{name.replace('.', '/')}/{sub}.py" not in f:
                    problems.append(f"{source.relative_to(REPO)}:{line}: imports {name}.{sub}, not shipped")
    assert not problems, "\n".join(problems)


def launchers() -> dict[str, str]:
    """{launcher name: the package whose .install puts it into /usr/bin}."""
    out = {}
    for package in ("dsv41-agent", "dsv41-coordinator", "dsv41-adapter", "dsv41-sim"):
        for src, dest in install_entries(package):
            if dest == "usr/bin":
                out[Path(src).name] = package
    return out


def test_every_launcher_is_installed_by_one_package_with_its_modules() -> None:
    owners = launchers()
    assert set(owners) == {p.name for p in (REPO / "packaging" / "bin").iterdir()}
    for name, package in owners.items():
        text = (REPO / "packaging" / "bin" / name).read_text()
        assert re.search(r'sys\.path\.insert\(0, "(.+?)"\)', text).group(1) == private_dir(package), name
        module = re.search(r'^MODULE = "(.+?)"$', text, re.MULTILINE).group(1)
        files = shipped_files(package)
        root = private_dir(package)
        wanted = (*module_paths(module, root), f"{root}/{module.replace('.', '/')}/__main__.py")
        if module == "coordinator.daemon" and not (REPO / "coordinator" / "daemon.py").exists():
            continue  # the launcher says so at run time; the unit test of the tree cannot help
        assert any(w in files for w in wanted), f"{name}: {module} is not shipped by {package}"


def test_units_are_installed_with_the_launcher_they_start() -> None:
    owners = launchers()
    for package, unit in (("dsv41-agent", "dsv41-agent.service"),
                          ("dsv41-coordinator", "dsv41-coordinator.service")):
        # installed where Debian 12's dh_installsystemd looks; debian/rules moves it to /usr/lib
        assert (f"units/{unit}", "lib/systemd/system") in install_entries(package)
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.read_string((REPO / "units" / unit).read_text())
        executable = parser["Service"]["ExecStart"].split()[0]
        assert executable.startswith("/usr/bin/") and owners[executable[len("/usr/bin/"):]] == package, unit
        assert "--config /etc/dsv41/" in parser["Service"]["ExecStart"]
        config = parser["Service"]["ExecStart"].split("--config ")[1].split()[0]
        assert (f"packaging/etc/{Path(config).name}", "etc/dsv41") in install_entries(package), config


def test_coordinator_unit() -> None:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.read_string((REPO / "units" / "dsv41-coordinator.service").read_text())
    service = parser["Service"]
    assert service["Type"] == "notify"
    assert service["ExecStart"] == "/usr/bin/dsv41-coordinator --config /etc/dsv41/cluster.env"
    assert service["Restart"] == "on-failure"
    assert service["KillMode"] == "mixed"  # SIGTERM to the coordinator only; it stops the cluster
    assert service["RuntimeDirectory"] == "dsv41"
    # Longer than the default rank drain budget, which the coordinator waits for on stop.
    from coordinator import schema
    drain = int(next(k.default for k in schema.KEYS if k.name == "RANK_STOP_TIMEOUT_S"))
    assert int(service["TimeoutStopSec"].removesuffix("s")) > drain
    assert "dsv41-agent.service" in parser["Unit"]["After"].split()  # stops before the head's agent
    sysusers = (REPO / "units" / "dsv41.sysusers").read_text().split("\n")
    assert "g dsv41 -" in sysusers


def test_maintainer_scripts_keep_debhelper_snippets() -> None:
    for script in DEBIAN.glob("*.post*"), DEBIAN.glob("*.pre*"):
        for path in script:
            text = path.read_text()
            assert text.startswith("#!/bin/sh\nset -e\n") and "#DEBHELPER#" in text, path.name
            assert path.stat().st_mode & 0o111, f"{path.name}: not executable"
