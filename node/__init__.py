"""The geotrain node daemon: config, identity, secure transport, trainer and the `geotrain` CLI."""
