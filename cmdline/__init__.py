"""The command lines, composed on top of the packages: ``snapctl`` and ``mountfs`` take their
commands from mountfs (the store and FUSE), replicator and daemon, each imported only when
its command runs. Imports run one way: mountfs never imports replicator or daemon, the
replicator never imports the daemon; only this package sees them all."""
