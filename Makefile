# `make` builds the release binary; `sudo make install` installs it as a systemd service
# (scripts/install.sh: the binary, the unit, and the default policy unless one exists).
# Staging: make install DESTDIR=/tmp/stage PREFIX=/usr
PREFIX ?= /usr/local
DESTDIR ?=

.PHONY: all build install

all: build

build:
	cargo build --release --locked

install:
	DESTDIR="$(DESTDIR)" PREFIX="$(PREFIX)" ./scripts/install.sh
