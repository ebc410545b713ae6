//! What names, labels and variable names may be.

pub(crate) fn valid_env_name(n: &str) -> bool {
    let mut b = n.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

pub(crate) fn valid_name(n: &str) -> bool {
    (1..=128).contains(&n.chars().count()) && !n.chars().any(|c| c.is_control())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_1_to_128_characters_without_control_characters() {
        assert!(valid_name("a"));
        assert!(valid_name(&"é".repeat(128)));
        assert!(!valid_name(""));
        assert!(!valid_name(&"a".repeat(129)));
        assert!(!valid_name("a\nb"));
    }

    #[test]
    fn variable_names_are_shell_identifiers() {
        assert!(valid_env_name("_A1"));
        assert!(valid_env_name("path"));
        assert!(!valid_env_name("1A"));
        assert!(!valid_env_name("A-B"));
        assert!(!valid_env_name(""));
    }
}
