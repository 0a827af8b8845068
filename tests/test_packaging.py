"""The version string has one source (``pyro_cvi.__version__``, read by setup.cfg); the
citation file and the licence agree with the package metadata."""

import configparser
import re
from pathlib import Path

import pyro_cvi

ROOT = Path(__file__).resolve().parents[1]


def test_version_single_sourced():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["metadata"]["version"].strip() == "attr: pyro_cvi.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+([a-z]+\d+)?", pyro_cvi.__version__)


def test_citation_matches_version():
    text = (ROOT / "CITATION.cff").read_text()
    version = re.search(r"^version:\s*(\S+)", text, re.M).group(1)
    assert version == pyro_cvi.__version__, "bump CITATION.cff together with __version__"


def test_license_matches_metadata():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["metadata"]["license"].strip() == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert "Version 2.0" in (ROOT / "LICENSE").read_text()[:200]
