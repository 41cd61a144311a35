//! The events' timestamps: RFC 3339, UTC, milliseconds.

use std::time::{SystemTime, UNIX_EPOCH};

pub(super) fn system_time_rfc3339(t: SystemTime) -> String {
    let (secs, millis) = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (
            i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            d.subsec_millis(),
        ),
        Err(_) => (0, 0),
    };
    rfc3339_millis(secs, millis).unwrap_or_else(|| "1970-01-01T00:00:00.000Z".into())
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` for a Unix time (civil-from-days, proleptic Gregorian); `None`
/// past year 9999, which RFC 3339 cannot write.
pub(super) fn rfc3339_millis(secs: i64, millis: u32) -> Option<String> {
    let days = secs.div_euclid(86_400);
    let of_day = secs.rem_euclid(86_400);
    let z = days.checked_add(719_468)?;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    if !(0..=9999).contains(&year) || millis > 999 {
        return None;
    }
    Some(format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        of_day / 3600,
        of_day / 60 % 60,
        of_day % 60
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339() {
        assert_eq!(rfc3339_millis(0, 0).unwrap(), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            rfc3339_millis(951_782_400, 7).unwrap(),
            "2000-02-29T00:00:00.007Z"
        );
        assert_eq!(
            rfc3339_millis(253_402_300_799, 999).unwrap(),
            "9999-12-31T23:59:59.999Z"
        );
        assert_eq!(rfc3339_millis(253_402_300_800, 0), None);
        assert_eq!(rfc3339_millis(i64::MAX, 0), None);
        assert_eq!(rfc3339_millis(-1, 0).unwrap(), "1969-12-31T23:59:59.000Z");
        assert_eq!(rfc3339_millis(0, 1000), None);
        assert_eq!(
            system_time_rfc3339(UNIX_EPOCH + std::time::Duration::from_millis(1_764_432_062_123)),
            "2025-11-29T16:01:02.123Z"
        );
        assert_eq!(
            system_time_rfc3339(UNIX_EPOCH - std::time::Duration::from_secs(1)),
            "1970-01-01T00:00:00.000Z"
        );
    }
}
