"""Operations: systemd notification and watchdog, SIGHUP reload, drain."""
