//! TLS and credentials of every Kafka client nrtxn makes (the producer, the readers, the
//! responses reader, the admin client, the outbox relay and `follow`'s topic reader), so
//! that one set of options secures them all.

use std::path::PathBuf;

use rdkafka::config::ClientConfig;

pub use nrtxn_actors::Secret;

/// librdkafka's `security.protocol` values.
pub const SECURITY_PROTOCOLS: [&str; 4] = ["plaintext", "ssl", "sasl_plaintext", "sasl_ssl"];
/// The SASL mechanisms this build of librdkafka has without Kerberos (GSSAPI would need
/// libsasl2) or an OAuth token provider.
pub const SASL_MECHANISMS: [&str; 3] = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"];

/// How nrtxn's Kafka clients connect: plaintext by default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KafkaSecurity {
    /// `security.protocol`: one of [`SECURITY_PROTOCOLS`]; librdkafka's default
    /// (plaintext) when `None`.
    pub protocol: Option<String>,
    /// `sasl.mechanism`: one of [`SASL_MECHANISMS`].
    pub sasl_mechanism: Option<String>,
    pub sasl_username: Option<String>,
    pub sasl_password: Option<Secret>,
    /// `ssl.ca.location`: a PEM file of the CA that signed the brokers' certificates;
    /// the system's CAs when `None`.
    pub ssl_ca: Option<PathBuf>,
}

impl KafkaSecurity {
    /// Checks that the options fit together; the error names the option (as in the
    /// configuration file, with underscores).
    pub fn check(&self) -> Result<(), String> {
        let protocol = self.protocol.as_deref().unwrap_or("plaintext");
        if !SECURITY_PROTOCOLS.contains(&protocol) {
            return Err(format!(
                "kafka_security_protocol: must be one of {}, got {protocol:?}",
                SECURITY_PROTOCOLS.join(", ")
            ));
        }
        let sasl = protocol.starts_with("sasl_");
        let tls = protocol.ends_with("ssl");
        match (&self.sasl_mechanism, sasl) {
            (Some(m), _) if !SASL_MECHANISMS.contains(&m.as_str()) => {
                return Err(format!(
                    "kafka_sasl_mechanism: must be one of {}, got {m:?}",
                    SASL_MECHANISMS.join(", ")
                ))
            }
            (Some(_), false) => {
                return Err(format!(
                    "kafka_sasl_mechanism: needs kafka_security_protocol sasl_ssl or \
                     sasl_plaintext, not {protocol}"
                ))
            }
            (None, true) => {
                return Err(format!(
                    "kafka_sasl_mechanism: required with kafka_security_protocol {protocol} \
                     (one of {})",
                    SASL_MECHANISMS.join(", ")
                ))
            }
            _ => {}
        }
        match (&self.sasl_username, &self.sasl_password) {
            (Some(_), None) => return Err("kafka_sasl_password: required with kafka_sasl_username (or NRTXN_KAFKA_SASL_PASSWORD)".into()),
            (None, Some(_)) => return Err("kafka_sasl_username: required with kafka_sasl_password".into()),
            (Some(_), Some(_)) if !sasl => {
                return Err(format!(
                    "kafka_sasl_username: credentials need kafka_security_protocol sasl_ssl \
                     or sasl_plaintext, not {protocol}"
                ))
            }
            (None, None) if sasl => {
                return Err(format!(
                    "kafka_sasl_username: required with kafka_security_protocol {protocol}"
                ))
            }
            _ => {}
        }
        if let Some(ca) = &self.ssl_ca {
            if !tls {
                return Err(format!(
                    "kafka_ssl_ca: needs kafka_security_protocol ssl or sasl_ssl, not {protocol}"
                ));
            }
            if !ca.is_file() {
                return Err(format!(
                    "kafka_ssl_ca: {} is not a readable file",
                    ca.display()
                ));
            }
        }
        Ok(())
    }

    /// A client configuration for `brokers` with these settings; every nrtxn client
    /// starts from it.
    pub fn client_config(&self, brokers: &str) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", brokers);
        if let Some(p) = &self.protocol {
            config.set("security.protocol", p);
        }
        if let Some(m) = &self.sasl_mechanism {
            config.set("sasl.mechanism", m);
        }
        if let Some(u) = &self.sasl_username {
            config.set("sasl.username", u);
        }
        if let Some(p) = &self.sasl_password {
            config.set("sasl.password", p.expose());
        }
        if let Some(ca) = &self.ssl_ca {
            config.set("ssl.ca.location", ca.to_string_lossy());
        }
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sasl_ssl() -> KafkaSecurity {
        KafkaSecurity {
            protocol: Some("sasl_ssl".into()),
            sasl_mechanism: Some("SCRAM-SHA-512".into()),
            sasl_username: Some("nrtxn".into()),
            sasl_password: Some("pw".parse::<Secret>().unwrap()),
            ssl_ca: None,
        }
    }

    #[test]
    fn options_that_do_not_fit_together_are_named() {
        assert_eq!(KafkaSecurity::default().check(), Ok(()));
        assert_eq!(sasl_ssl().check(), Ok(()));
        let err = |s: KafkaSecurity| s.check().unwrap_err();
        assert!(err(KafkaSecurity {
            protocol: Some("tls".into()),
            ..KafkaSecurity::default()
        })
        .starts_with("kafka_security_protocol:"));
        assert!(err(KafkaSecurity {
            sasl_password: None,
            ..sasl_ssl()
        })
        .starts_with("kafka_sasl_password:"));
        assert!(err(KafkaSecurity {
            sasl_mechanism: None,
            ..sasl_ssl()
        })
        .starts_with("kafka_sasl_mechanism:"));
        assert!(err(KafkaSecurity {
            protocol: Some("ssl".into()),
            ..sasl_ssl()
        })
        .starts_with("kafka_sasl_mechanism:"));
        assert!(err(KafkaSecurity {
            ssl_ca: Some("/no/such/ca.pem".into()),
            ..sasl_ssl()
        })
        .starts_with("kafka_ssl_ca:"));
    }

    /// librdkafka refuses, when a client is created, a `security.protocol` or SASL
    /// mechanism it was built without (`OpenSSL not available at build time`): this build
    /// must take every combination the options allow. No broker is contacted.
    #[test]
    fn this_build_of_librdkafka_takes_every_protocol_and_mechanism() {
        use rdkafka::producer::BaseProducer;
        for protocol in SECURITY_PROTOCOLS {
            let sasl = protocol.starts_with("sasl_");
            let mechanisms: &[&str] = if sasl { &SASL_MECHANISMS } else { &[""] };
            for mechanism in mechanisms {
                let security = KafkaSecurity {
                    protocol: Some(protocol.into()),
                    sasl_mechanism: sasl.then(|| mechanism.to_string()),
                    sasl_username: sasl.then(|| "nrtxn".into()),
                    sasl_password: sasl.then(|| "pw".parse::<Secret>().unwrap()),
                    ssl_ca: None,
                };
                assert_eq!(security.check(), Ok(()));
                let created: Result<BaseProducer, _> =
                    security.client_config("127.0.0.1:1").create();
                assert!(
                    created.is_ok(),
                    "{protocol} {mechanism}: {:?}",
                    created.err()
                );
            }
        }
    }

    #[test]
    fn a_password_is_never_printed() {
        assert!(!format!("{:?}", sasl_ssl()).contains("pw"));
        let config = sasl_ssl().client_config("k:9092");
        assert_eq!(config.get("sasl.password"), Some("pw"));
        assert_eq!(config.get("security.protocol"), Some("sasl_ssl"));
    }
}
